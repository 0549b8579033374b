# Each target sets up what it needs (scripts/install.sh is idempotent and caches the Horovod wheel).
.PHONY: install demo demo-hosts test
install:
	bash scripts/install.sh
demo:
	bash scripts/demo.sh
# The demo across 2 emulated hosts (root): bytes between them on eth0, dense vs TopKEF.
demo-hosts:
	bash scripts/install.sh
	bash scripts/hosts.sh demo
test:
	bash scripts/test.sh
