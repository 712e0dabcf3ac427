"""Skyward's pool settings: Compute(ttl=, allocation=) given to the provider's settings of
that meaning, Options(provision_timeout=) as start_timeout."""

from __future__ import annotations

import pytest

import flotilla as sky
from flotilla._providers.local import Local


def test_provision_timeout_is_the_start_timeout() -> None:
    assert sky.Options(provision_timeout=7).start_timeout == 7
    assert sky.Options().start_timeout == 120.0 and sky.Options().provision_timeout is None
    with pytest.raises(sky.ConfigurationError, match="provision_timeout"):
        sky.Options(provision_timeout=0)


def test_a_pool_starts_with_provision_timeout() -> None:
    with sky.Compute(nodes=1, options=sky.Options(provision_timeout=60)) as pool:
        assert pool.options.start_timeout == 60


def test_ttl_and_allocation_reach_the_aws_settings_of_a_copy() -> None:
    aws = sky.AWS(region="us-east-1")
    pool = sky.Compute(provider=aws, ttl=1800, allocation="on-demand")
    assert isinstance(pool.provider, sky.AWS)
    assert pool.provider.settings.ttl == 1800 and pool.provider.settings.allocation == "on-demand"
    assert aws.settings.ttl == 600 and aws.settings.allocation == "spot-if-available"
    assert pool.ttl == 1800 and pool.allocation == "on-demand"
    same = sky.Compute(provider=aws, ttl=0)  # 0: the provider's own
    assert same.provider is aws


def test_ttl_is_a_slurm_time_limit() -> None:
    pool = sky.Compute(provider=sky.Slurm(), ttl=600)
    assert isinstance(pool.provider, sky.Slurm)
    assert pool.provider.time_limit == 600


def test_providers_that_rent_nothing_accept_every_allocation() -> None:
    for allocation in ("spot", "on-demand", "spot-if-available"):
        pool = sky.Compute(provider=Local(), allocation=allocation, ttl=60)
        assert isinstance(pool.provider, Local)


def test_bad_ttl_or_allocation_is_refused() -> None:
    with pytest.raises(sky.ConfigurationError, match=r"allocation='cheap': use one of 'spot'"):
        sky.Compute(allocation="cheap")
    with pytest.raises(sky.ConfigurationError, match="ttl"):
        sky.Compute(ttl=-1)
    with pytest.raises(sky.ConfigurationError, match="ttl"):
        sky.Compute(ttl="1h")  # type: ignore[arg-type]
