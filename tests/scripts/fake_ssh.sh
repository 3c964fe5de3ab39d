#!/bin/bash
# Stand-in for ssh in tests: drops the options, records the host in
# FAKE_SSH_HOST and runs the remote command with a local shell, exactly as
# ssh hands its joined arguments to the remote user's shell.
while [ $# -gt 0 ]; do
  case "$1" in
    -o|-p|-i|-l) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
export FAKE_SSH_HOST="$1"
shift
exec /bin/bash -c "$*"
