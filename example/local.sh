#!/usr/bin/env bash
# A local helper script: copied to the host with the rest of this folder.
echo "local.sh ran on $(hostname) in $(pwd)"
