#!/usr/bin/env python3
"""Creates (or deletes) an Azure Blob container with Shared Key authorisation, the way Azure's SDKs
sign a request (python's standard library only): neither restic nor kopia creates containers.

    azure_container.py create|delete <account URL> <account> <base64 key> <container> [CA file]

Exit 0 when done (201/202, or 409 "ContainerAlreadyExists" on create); else the service's answer
on stderr and exit 1.
"""
import base64
import hashlib
import hmac
import ssl
import sys
import urllib.error
import urllib.parse
import urllib.request
from email.utils import formatdate

API_VERSION = "2021-12-02"


def main():
    verb, url, account, key, container = sys.argv[1:6]
    ca = sys.argv[6] if len(sys.argv) > 6 else None
    method = {"create": "PUT", "delete": "DELETE"}[verb]
    headers = {"x-ms-date": formatdate(usegmt=True), "x-ms-version": API_VERSION}
    canonical_headers = "".join(f"{k}:{v}\n" for k, v in sorted(headers.items()))
    # Shared Key: VERB, 11 standard headers (all empty here, Content-Length "" for 0), the
    # x-ms-* headers, then /<account>/<container> and the sorted query parameters.
    # The resource is the account and the URL's whole path (an emulator's path-style URL has the
    # account in its path too).
    path = urllib.parse.urlparse(url).path.rstrip("/") + "/" + container
    string_to_sign = (
        f"{method}\n" + "\n" * 11 + canonical_headers + f"/{account}{path}\nrestype:container"
    )
    sig = base64.b64encode(
        hmac.new(base64.b64decode(key), string_to_sign.encode(), hashlib.sha256).digest()
    ).decode()
    headers["Authorization"] = f"SharedKey {account}:{sig}"
    req = urllib.request.Request(
        f"{url.rstrip('/')}/{container}?restype=container", method=method, headers=headers
    )
    ctx = ssl.create_default_context(cafile=ca) if ca else None
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=30) as r:
            r.read()
    except urllib.error.HTTPError as e:
        body = e.read().decode(errors="replace")
        if verb == "create" and e.code == 409 and "ContainerAlreadyExists" in body:
            return 0
        print(f"azure_container.py: {verb} {container}: HTTP {e.code}: {body}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
