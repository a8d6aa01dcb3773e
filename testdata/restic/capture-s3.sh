#!/usr/bin/env bash
# Captures restic's output against a real S3 server (moto, from scripts/install-moto.sh) behind
# TLS with a CA made here: the s3-* fixtures. Run from the repository root:
#   testdata/restic/capture-s3.sh
# The server's port is normalised to PORT; everything else is byte for byte.
set -euo pipefail
cd "$(dirname "$0")/../.."
moto=${PODVOLUME_MOTO_SERVER:-target/test-tools/moto/bin/moto_server}
out=$PWD/testdata/restic
T=$(mktemp -d)
trap 'kill "$pid" 2>/dev/null; rm -rf "$T"' EXIT
cd "$T"
openssl req -x509 -newkey rsa:2048 -nodes -days 2 -keyout ca.key -out ca.pem -subj "/CN=test CA" \
  -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign 2>/dev/null
openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj /CN=127.0.0.1 2>/dev/null
printf 'subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n' >server.ext
openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 -out server.pem \
  -extfile server.ext 2>/dev/null
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
# Set-up makes 3 requests per user + 1 per created bucket; signatures are enforced after that.
INITIAL_NO_AUTH_ACTION_COUNT=8 "$OLDPWD/$moto" -H 127.0.0.1 -p "$port" -c server.pem -k server.key >moto.log 2>&1 &
pid=$!
for _ in $(seq 100); do (echo >/dev/tcp/127.0.0.1/$port) 2>/dev/null && break; sleep 0.1; done
"$(dirname "$OLDPWD/$moto")/python" "$OLDPWD/tests/s3/moto_setup.py" "https://127.0.0.1:$port" ca.pem \
  '[{"user":"alice","buckets":["bkt-a"],"absent":["bkt-missing"]},{"user":"bob","buckets":["bkt-b"]}]' >keys.json
python3 - <<'PY'
import json
k = json.load(open("keys.json"))
def f(name, key_id, secret):
    open(name, "w").write(f"[default]\naws_access_key_id = {key_id}\naws_secret_access_key = {secret}\n")
f("alice", k["alice"]["accessKeyId"], k["alice"]["secretAccessKey"])
f("bob", k["bob"]["accessKeyId"], k["bob"]["secretAccessKey"])
f("unknown-key", "AKIAUNKNOWNKEY000000", "whatever")
f("wrong-secret", k["alice"]["accessKeyId"], "not-the-secret")
PY
echo "test password" >pw
mkdir data && head -c 100000 /dev/urandom >data/a.bin
ep="https://127.0.0.1:$port"
capture() { # name credentials repo restic-args...
  local name=$1 cred=$2 repo=$3; shift 3
  set +e
  (cd data && AWS_SHARED_CREDENTIALS_FILE=$T/$cred RESTIC_PASSWORD_FILE=$T/pw RESTIC_REPOSITORY=$repo \
    restic --cache-dir "$T/cache" "$@" </dev/null >"$T/$name.stdout" 2>"$T/$name.stderr")
  echo $? >"$out/$name.exit"
  set -e
  for s in stdout stderr; do sed "s/127\.0\.0\.1:$port/127.0.0.1:PORT/g" "$T/$name.$s" >"$out/$name.$s"; done
}
capture s3-no-ca alice "s3:$ep/bkt-a/restic/ns" --json backup --host=velero .
capture s3-repo-missing alice "s3:$ep/bkt-a/restic/ns" --cacert "$T/ca.pem" --json backup --host=velero .
capture s3-no-such-bucket alice "s3:$ep/bkt-missing/restic/ns" --cacert "$T/ca.pem" --json backup --host=velero .
capture s3-access-denied bob "s3:$ep/bkt-a/restic/ns" --cacert "$T/ca.pem" --json backup --host=velero .
capture s3-unknown-key unknown-key "s3:$ep/bkt-a/restic/ns" --cacert "$T/ca.pem" --json backup --host=velero .
capture s3-wrong-secret wrong-secret "s3:$ep/bkt-a/restic/ns" --cacert "$T/ca.pem" --json backup --host=velero .
capture s3-dns alice "s3:https://no-such-host.invalid/bkt-a/restic/ns" --json backup --host=velero .
capture s3-init-access-denied bob "s3:$ep/bkt-a/restic/ns" --cacert "$T/ca.pem" init
ls "$out"/s3-*
