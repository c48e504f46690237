# txbroker — the two sacred commands: `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DATA   ?= ./txbroker-data

.PHONY: venv run test lint postgres java chromium openssl etcd bench clean

venv: $(STAMP)

# The hot path (core/, protocol/, the storage encoders) is compiled with mypyc by the
# install (setup.py): reinstall when one of its sources changes. Without a C compiler,
# or with TXBROKER_PURE=1, the install is pure Python (docs/performance.md).
COMPILED_SRC := $(shell $(PYTHON) src/txbroker/_build.py sources) \
                src/txbroker/_build.py setup.py

$(STAMP): pyproject.toml $(COMPILED_SRC)
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,spark]'
	$(PY) -c 'import txbroker._build as b, txbroker; print("txbroker build:", b.MODE)'
	touch $(STAMP)

run: venv
	$(VENV)/bin/txbroker serve --data $(DATA) --http-port 8161

lint: venv
	$(VENV)/bin/ruff check src tests bench setup.py
	$(VENV)/bin/mypy src
	$(VENV)/bin/lint-imports pyproject.toml

# The whole suite on the build the install made (compiled where a C compiler is), then
# the pure-Python modules of the compiled set on their own tests (TXBROKER_PURE=1).
PURE_TESTS := $(shell $(PYTHON) src/txbroker/_build.py pure-tests)

test: venv lint postgres java chromium openssl etcd
	$(PY) -m pytest -q
	TXBROKER_PURE=1 $(PY) -m pytest -q -p no:cacheprovider $(PURE_TESTS)

# The XA tests start their own PostgreSQL (initdb in a temp dir): install the
# Debian package when it is missing.
postgres:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || \
	  ( $$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive $$( [ "$$(id -u)" = 0 ] || echo sudo ) \
	    apt-get install -y -qq postgresql )

# Spark (the connectors' and the audit job's tests) needs a Java 17+ runtime.
java:
	@java -version >/dev/null 2>&1 || \
	  ( $$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive $$( [ "$$(id -u)" = 0 ] || echo sudo ) \
	    apt-get install -y -qq openjdk-17-jre-headless )

# The console's browser tests (tests/http/test_console.py) drive Debian's chromium
# through its chromedriver (one apt command, so that their versions match).
chromium:
	@( [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ] ) || \
	  ( $$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive $$( [ "$$(id -u)" = 0 ] || echo sudo ) \
	    apt-get install -y -qq chromium chromium-driver )

# The TLS tests make their own CA and certificates with the openssl command line
# (tests/tls_support.py).
openssl:
	@command -v openssl >/dev/null 2>&1 || \
	  ( $$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive $$( [ "$$(id -u)" = 0 ] || echo sudo ) \
	    apt-get install -y -qq openssl )

# The HA tests (tests/server/test_etcd.py) start their own etcd on a free loopback
# port (tests/etcd_support.py); etcdctl comes with etcd-client.
etcd:
	@( command -v etcd >/dev/null 2>&1 && command -v etcdctl >/dev/null 2>&1 ) || \
	  ( $$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive $$( [ "$$(id -u)" = 0 ] || echo sudo ) \
	    apt-get install -y -qq etcd-server etcd-client )

bench: venv
	$(PY) bench/run_core.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
