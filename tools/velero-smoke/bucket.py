"""Reads the smoke test's bucket directly (moto refuses Velero's pre-signed download URLs when it
enforces IAM, so `velero backup/restore describe` cannot fetch these files). Run with the Python
of moto's venv (it has boto3).

usage: bucket.py ENDPOINT CA_PEM CREDENTIALS_FILE BUCKET count PREFIX...   object counts, one line
       bucket.py ENDPOINT CA_PEM CREDENTIALS_FILE BUCKET json KEY          a (gzipped) JSON object
"""
import configparser
import gzip
import json
import sys

import boto3

url, ca, cred, bucket, cmd, args = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6:]
c = configparser.ConfigParser()
c.read(cred)
s3 = boto3.client("s3", endpoint_url=url, verify=ca, region_name="us-east-1",
                  aws_access_key_id=c["default"]["aws_access_key_id"],
                  aws_secret_access_key=c["default"]["aws_secret_access_key"])
if cmd == "count":
    pages = lambda p: s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=p)
    print(*(sum(len(page.get("Contents", [])) for page in pages(p)) for p in args))
elif cmd == "json":
    body = s3.get_object(Bucket=bucket, Key=args[0])["Body"].read()
    if args[0].endswith(".gz"):
        body = gzip.decompress(body)
    print(json.dumps(json.loads(body)))
else:
    sys.exit(f"unknown command {cmd}")
