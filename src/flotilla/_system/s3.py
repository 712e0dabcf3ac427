"""The standard-library S3 client (SigV4): the few calls that bucket volumes
(``flotilla._node.volumes``) and :mod:`flotilla.storage` need, with no SDK installed.

Standard library only: nodes run it with nothing but Python.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import http.client
import os
import urllib.parse
import xml.etree.ElementTree as ET
from collections.abc import Iterator

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import BinaryIO

_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"
_EMPTY_SHA = hashlib.sha256(b"").hexdigest()
_CHUNK = 1 << 20


class S3Error(Exception):
    """An S3 request failed (``status``: the HTTP status, 0 when none came)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class S3:
    """The few S3 calls volumes need, signed with SigV4, standard library only."""

    def __init__(self, credentials: dict[str, str], region: str, endpoint: str | None) -> None:
        self.key = credentials["access_key"]
        self.secret = credentials["secret_key"]
        self.token = credentials.get("token") or ""
        self.region = region or "us-east-1"
        self.endpoint = endpoint or ""

    def _where(self, bucket: str, key: str) -> tuple[str, str, str]:
        """(scheme, host, path) of an object (path-style on a custom endpoint)."""
        quoted = urllib.parse.quote(key, safe="/~")
        if self.endpoint:
            u = urllib.parse.urlsplit(self.endpoint)
            base = u.path.rstrip("/")
            return u.scheme or "https", u.netloc, f"{base}/{bucket}/{quoted}"
        return "https", f"{bucket}.s3.{self.region}.amazonaws.com", f"/{quoted}"

    def request(
        self,
        method: str,
        bucket: str,
        key: str = "",
        query: dict[str, str] | None = None,
        body: BinaryIO | None = None,
        length: int = 0,
    ) -> http.client.HTTPResponse:
        scheme, host, path = self._where(bucket, key)
        query = query or {}
        qs = "&".join(
            f"{urllib.parse.quote(k, safe='-_.~')}={urllib.parse.quote(v, safe='-_.~')}"
            for k, v in sorted(query.items())
        )
        now = datetime.datetime.now(datetime.UTC)
        stamp = now.strftime("%Y%m%dT%H%M%SZ")
        day = stamp[:8]
        payload = "UNSIGNED-PAYLOAD" if body is not None else _EMPTY_SHA
        headers = {"host": host, "x-amz-content-sha256": payload, "x-amz-date": stamp}
        if self.token:
            headers["x-amz-security-token"] = self.token
        if body is not None:
            headers["content-length"] = str(length)
        names = sorted(headers)
        canonical = "\n".join(
            [
                method,
                path,
                qs,
                "".join(f"{n}:{headers[n].strip()}\n" for n in names),
                ";".join(names),
                payload,
            ]
        )
        scope = f"{day}/{self.region}/s3/aws4_request"
        to_sign = "\n".join(
            ["AWS4-HMAC-SHA256", stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()]
        )
        k = hmac.new(f"AWS4{self.secret}".encode(), day.encode(), hashlib.sha256).digest()
        for part in (self.region, "s3", "aws4_request"):
            k = hmac.new(k, part.encode(), hashlib.sha256).digest()
        signature = hmac.new(k, to_sign.encode(), hashlib.sha256).hexdigest()
        headers["authorization"] = (
            f"AWS4-HMAC-SHA256 Credential={self.key}/{scope}, "
            f"SignedHeaders={';'.join(names)}, Signature={signature}"
        )
        conn_cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
        conn = conn_cls(host, timeout=60)
        try:
            conn.putrequest(method, path + (f"?{qs}" if qs else ""), skip_host=True)
            for name, value in headers.items():
                conn.putheader(name, value)
            conn.endheaders()
            if body is not None:
                while chunk := body.read(_CHUNK):
                    conn.send(chunk)
            resp = conn.getresponse()
        except OSError as e:
            conn.close()
            raise S3Error(f"cannot reach {scheme}://{host}: {e}") from e
        if resp.status >= 300:
            text = resp.read().decode(errors="replace")
            conn.close()
            code = _xml_text(text, "Code") or f"HTTP {resp.status}"
            raise S3Error(f"{method} s3://{bucket}/{key}: {code}", resp.status)
        return resp

    def list(self, bucket: str, prefix: str) -> Iterator[tuple[str, int]]:
        """(key, size) of every object under ``prefix``."""
        token = ""
        while True:
            query = {"list-type": "2", "prefix": prefix}
            if token:
                query["continuation-token"] = token
            resp = self.request("GET", bucket, query=query)
            root = ET.fromstring(resp.read())
            resp.close()
            for item in root.iter(f"{_NS}Contents"):
                yield item.findtext(f"{_NS}Key") or "", int(item.findtext(f"{_NS}Size") or 0)
            if (root.findtext(f"{_NS}IsTruncated") or "false") != "true":
                return
            token = root.findtext(f"{_NS}NextContinuationToken") or ""

    def download(self, bucket: str, key: str, path: str) -> None:
        """The object into ``path``: written beside it, then renamed (whole or absent)."""
        resp = self.request("GET", bucket, key)
        tmp = f"{path}.flotilla-part-{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                while chunk := resp.read(_CHUNK):
                    f.write(chunk)
            os.replace(tmp, path)
        finally:
            resp.close()
            if os.path.exists(tmp):
                os.unlink(tmp)

    def upload(self, bucket: str, key: str, path: str) -> None:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            self.request("PUT", bucket, key, body=f, length=size).close()


def _xml_text(text: str, tag: str) -> str:
    try:
        root = ET.fromstring(text)
    except ET.ParseError:
        return ""
    return root.findtext(tag) or root.findtext(f"{_NS}{tag}") or ""
