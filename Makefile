# nanochat on a LAN of CPU machines: entry points. `make help` lists them.
#
# Everything that drives podman (image, cluster-*, test, demo) runs as root: the node containers
# are privileged systemd containers on a podman network with static addresses and tc shaping.

SHELL := bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Extra index for torch, e.g. https://download.pytorch.org/whl/cpu (empty: PyPI and pip.conf only).
TORCH_INDEX ?=
# Workers of the local cluster: empty keeps inventory/local/hosts.yml as it is; a number rewrites it.
WORKERS ?=
# Demo training run.
DEPTH ?= 4
ITERATIONS ?= 50
# Inner steps between the nodes' outer syncs: 1 (synchronous every step), H or auto (local steps
# where the link is slow: the demo's three nodes, one on 100 Mbit/s, at 1.38-1.61x node0 alone where
# synchronous steps make 0.25x; docs/TRAINER.md, "Local steps across nodes").
SYNC_EVERY ?= auto
# Tokens per step: 24 rows of 512, enough for the speed split to give node0 twice a laptop's rows.
BATCH ?= 12288
# Molecule scenarios `make test` runs.
SCENARIOS ?= default

INVENTORY := inventory/local
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# Ansible and molecule from the venv, whatever the caller's PATH.
export PATH := $(abspath $(BIN)):$(PATH)
export ANSIBLE_FORCE_COLOR ?= false

.PHONY: help setup host venv image root cluster-up cluster-down cluster-status lint test pytest molecule demo

help:
	@echo 'make setup          host packages + podman config (cluster/host_setup.sh) and the .venv'
	@echo 'make image          build the node image localhost/nanochat-node (cluster/build_node_image.sh)'
	@echo 'make cluster-up     start the local cluster in inventory/local (WORKERS=N rewrites it with N workers)'
	@echo 'make cluster-down   remove the local cluster'
	@echo 'make lint           ruff, yamllint, ansible-lint'
	@echo 'make test           pytest, then molecule test for SCENARIOS ($(SCENARIOS))'
	@echo 'make demo           setup, image, cluster-up, site.yml, train.yml -e depth=$(DEPTH) -e num_iterations=$(ITERATIONS) -e sync_every=$(SYNC_EVERY) -e total_batch_size=$(BATCH)'

setup: host venv

host:
	$(SUDO) cluster/host_setup.sh

venv: $(VENV)/.installed

$(VENV)/.installed: requirements-dev.txt
	[ -x $(BIN)/python ] || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) -r requirements-dev.txt
	touch $@

image: host
	$(SUDO) cluster/build_node_image.sh

# ansible-playbook drives podman as the calling user; the cluster needs rootful podman.
root:
	@[ "$$(id -u)" = 0 ] || { echo 'make: run this target as root (the local cluster uses rootful podman)' >&2; exit 1; }

cluster-up: root venv image
	time ansible-playbook -i $(INVENTORY) cluster/up.yml $(if $(WORKERS),-e local_workers=$(WORKERS))

cluster-down: root venv
	time ansible-playbook -i $(INVENTORY) cluster/down.yml

cluster-status: root venv
	podman ps --filter label=org.nanochat.cluster --format 'table {{.Names}}\t{{.Status}}\t{{.Labels}}'
	ansible -i $(INVENTORY) cluster -m ansible.builtin.ping

lint: venv
	ruff check .
	yamllint -s .
	ansible-lint

test: root host pytest molecule  # host first: pytest needs the fortunes and chromium packages

pytest: venv
	pytest

molecule: root venv image
	for s in $(SCENARIOS); do molecule test -s $$s; done

demo: root setup image cluster-up
	ansible-playbook -i $(INVENTORY) site.yml
	ansible-playbook -i $(INVENTORY) train.yml -e depth=$(DEPTH) -e num_iterations=$(ITERATIONS) -e sync_every=$(SYNC_EVERY) -e total_batch_size=$(BATCH) -e restart=true
	ansible-playbook -i $(INVENTORY) playbooks/demo_finish.yml -e depth=$(DEPTH)
