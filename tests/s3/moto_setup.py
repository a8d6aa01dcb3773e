"""Test set-up of a moto S3 server: IAM users, each with an access key allowed on its own buckets
only, and the buckets. Run with the Python of moto's private venv (it has boto3).

usage: moto_setup.py ENDPOINT CA_PEM '[{"user": "a", "buckets": ["bkt-a"], "absent": ["bkt-x"]}, ...]'
("absent": buckets the user may use that are not created)
prints {"a": {"accessKeyId": ..., "secretAccessKey": ...}, ...}

The server is started with INITIAL_NO_AUTH_ACTION_COUNT equal to the number of requests made
here (3 per user + 1 per bucket), so every later request must be signed by one of these keys.
"""
import json
import sys

import boto3
from botocore.config import Config

endpoint, ca, specs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
common = dict(
    endpoint_url=endpoint,
    verify=ca,
    region_name="us-east-1",
    aws_access_key_id="setup",
    aws_secret_access_key="setup",
    config=Config(retries={"max_attempts": 1}),
)
iam = boto3.client("iam", **common)
s3 = boto3.client("s3", **common)
keys = {}
for spec in specs:
    user, buckets = spec["user"], spec["buckets"]
    allowed = buckets + spec.get("absent", [])
    iam.create_user(UserName=user)
    resources = [f"arn:aws:s3:::{b}" for b in allowed] + [f"arn:aws:s3:::{b}/*" for b in allowed]
    policy = {
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": resources}],
    }
    iam.put_user_policy(UserName=user, PolicyName="own-buckets", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName=user)["AccessKey"]
    keys[user] = {"accessKeyId": key["AccessKeyId"], "secretAccessKey": key["SecretAccessKey"]}
    for b in buckets:
        s3.create_bucket(Bucket=b)
print(json.dumps(keys))
