#!/bin/sh
# Make a throwaway cluster CA and one certificate it signs, for pdserve's mTLS on worker gRPC (test and
# development clusters; in production a real CA or cert-manager issues them). Usage:
#
#   deploy/tls/make-certs.sh DIR [NAME] [DAYS]
#
# writes, in DIR, the files under the names Kubernetes' TLS secrets use, so one directory serves compose
# (mounted, docs/deployment.md) and the Helm chart (kubectl create secret generic pdserve-tls --from-file=DIR):
#   ca.crt   the CA every process trusts (PDSERVE_TLS_CA)
#   tls.crt  the certificate every process presents, server and client alike (PDSERVE_TLS_CERT)
#   tls.key  its key (PDSERVE_TLS_KEY)
# The certificate names NAME (default pdserve-worker), which every process checks instead of the address it
# dials (PDSERVE_TLS_SERVER_NAME; containers' and pods' IPs change at every start), plus localhost and
# 127.0.0.1. The CA's key is deleted: nothing more can be signed with it. DAYS defaults to 365.
set -eu
dir=${1:?usage: make-certs.sh DIR [NAME] [DAYS]}
name=${2:-pdserve-worker}
days=${3:-365}
mkdir -p "$dir"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
ec="-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
# shellcheck disable=SC2086
openssl req -x509 $ec -keyout "$work/ca.key" -out "$dir/ca.crt" -days "$days" -subj "/CN=$name-ca" 2>/dev/null
# shellcheck disable=SC2086
openssl req $ec -keyout "$dir/tls.key" -out "$work/node.csr" -subj "/CN=$name" 2>/dev/null
printf 'subjectAltName=DNS:%s,DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n' "$name" \
    > "$work/ext"
openssl x509 -req -in "$work/node.csr" -CA "$dir/ca.crt" -CAkey "$work/ca.key" -CAcreateserial \
    -CAserial "$work/ca.srl" -out "$dir/tls.crt" -days "$days" -extfile "$work/ext" 2>/dev/null
# The containers run as a non-root user: the key must be readable by it where the directory is mounted.
chmod 755 "$dir"
chmod 644 "$dir/ca.crt" "$dir/tls.crt" "$dir/tls.key"
echo "$dir: ca.crt, tls.crt, tls.key for $name (and localhost, 127.0.0.1), valid $days days"
