#!/bin/sh
# Health of the bootstrap node: its multiaddr file is written and its port accepts connections.
# Usage: healthcheck.sh MADDRS_FILE PORT
set -eu
test -s "$1"
exec python -c "import socket, sys; socket.create_connection(('127.0.0.1', int(sys.argv[1])), 2)" "$2"
