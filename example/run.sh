#!/usr/bin/env bash
# Two remote machines (edit machine.yaml and machine2.yaml first):
execute_batch batch_script.sh --machines machine.yaml machine2.yaml
