"""The Verda provider (see ``provider``); loaded on first use, so that its settings
(``settings``) load alone."""

from typing import TYPE_CHECKING

from .. import provider_loader

if TYPE_CHECKING:
    from .provider import Verda as Verda

__getattr__ = provider_loader(__name__, "Verda")
