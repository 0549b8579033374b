# Each target sets up what it needs (scripts/install.sh is idempotent and caches the Horovod wheel).
.PHONY: install demo test
install:
	bash scripts/install.sh
demo:
	bash scripts/demo.sh
test:
	bash scripts/test.sh
