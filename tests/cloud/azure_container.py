#!/usr/bin/env python3
"""Azure Blob container operations with Shared Key authorisation, signed the way Azure's SDKs sign
a request (python's standard library only): neither restic nor kopia creates containers, and the
tests list what the uploaders wrote.

    azure_container.py create|delete|list <account URL> <account> <base64 key> <container> [CA file] [prefix]

create/delete: exit 0 when done (201/202, or 409 ContainerAlreadyExists on create). list: the
names of the blobs under the prefix, one per line (the first 5000). Anything else: the service's
answer on stderr and exit 1.
"""
import base64
import hashlib
import hmac
import ssl
import sys
import urllib.error
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ET
from email.utils import formatdate

API_VERSION = "2021-12-02"


def main():
    verb, url, account, key, container = sys.argv[1:6]
    ca = sys.argv[6] if len(sys.argv) > 6 and sys.argv[6] else None
    prefix = sys.argv[7] if len(sys.argv) > 7 else ""
    method = {"create": "PUT", "delete": "DELETE", "list": "GET"}[verb]
    query = {"restype": "container"}
    if verb == "list":
        query.update({"comp": "list", "prefix": prefix})
    headers = {"x-ms-date": formatdate(usegmt=True), "x-ms-version": API_VERSION}
    canonical_headers = "".join(f"{k}:{v}\n" for k, v in sorted(headers.items()))
    # Shared Key: VERB, 11 standard headers (all empty here), the x-ms-* headers, then the
    # resource: the account and the URL's whole path (an emulator's path-style URL has the
    # account in its path too), and the sorted query parameters.
    path = urllib.parse.urlparse(url).path.rstrip("/") + "/" + container
    resource = f"/{account}{path}" + "".join(f"\n{k}:{v}" for k, v in sorted(query.items()))
    string_to_sign = f"{method}\n" + "\n" * 11 + canonical_headers + resource
    sig = base64.b64encode(
        hmac.new(base64.b64decode(key), string_to_sign.encode(), hashlib.sha256).digest()
    ).decode()
    headers["Authorization"] = f"SharedKey {account}:{sig}"
    req = urllib.request.Request(
        f"{url.rstrip('/')}/{container}?{urllib.parse.urlencode(query)}", method=method, headers=headers
    )
    ctx = ssl.create_default_context(cafile=ca) if ca else None
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=30) as r:
            body = r.read()
    except urllib.error.HTTPError as e:
        body = e.read().decode(errors="replace")
        if verb == "create" and e.code == 409 and "ContainerAlreadyExists" in body:
            return 0
        print(f"azure_container.py: {verb} {container}: HTTP {e.code}: {body}", file=sys.stderr)
        return 1
    if verb == "list":
        for name in ET.fromstring(body).iter("Name"):
            print(name.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
