#!/usr/bin/env bash
# On each TPU VM worker (launch/tpu_pod.py train): runs COMMAND with its output in LOG and, when LOGS_URL
# is not empty, copies LOG to LOGS_URL/HOSTNAME.log every COPY_EVERY_S seconds (60) and once more when
# COMMAND ends: a Spot VM's disk is deleted with it, the bucket keeps the copy. A SIGTERM or SIGINT to
# this script (`tpu_pod.py stop`) goes to COMMAND, which saves a checkpoint and exits; this script then
# exits with COMMAND's status.
#   usage: pod_worker.sh LOG LOGS_URL COMMAND...
set -u
log=$1 url=$2
shift 2
dest="${url%/}/$(hostname).log"
copy() {
  [ -n "$url" ] || return 0
  timeout 300 gcloud storage cp --quiet "$log" "$dest" > /dev/null 2>&1 \
    || echo "pod_worker: could not copy $log to $dest" >> "$log"
}
: > "$log"
"$@" >> "$log" 2>&1 < /dev/null &
child=$!
trap 'kill -TERM "$child" 2> /dev/null' TERM INT
copier=""
if [ -n "$url" ]; then
  (trap - TERM INT; while sleep "${COPY_EVERY_S:-60}"; do copy; done) &
  copier=$!
fi
while :; do
  wait "$child"
  status=$?
  kill -0 "$child" 2> /dev/null || break  # still running: wait returned for a trapped signal
done
if [ -n "$copier" ]; then kill "$copier" 2> /dev/null; fi
copy
exit "$status"
