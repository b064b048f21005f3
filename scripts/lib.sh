# Shared helpers for the relay's scripts: start what the tests and the demo
# need on a machine that may have nothing running (CI, a fresh checkout).
# Source it; every function prints progress on stderr and fails loudly.
# shellcheck shell=bash

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE="${RELAY_CACHE_DIR:-$ROOT/.cache}"
PG_VERSION="${PG_VERSION:-15}"
STARTED_POSTGRES=""
KAFKA_PID=""
KAFKA_DIR=""
REGISTRY_PID=""

say() { printf '[relay] %s\n' "$*" >&2; }
die() { printf '[relay] error: %s\n' "$*" >&2; exit 1; }

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}

wait_for_port() { # host port seconds
  local deadline=$((SECONDS + $3))
  until (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; do
    [ $SECONDS -lt $deadline ] || return 1
    sleep 0.2
  done
}

# Start the local PostgreSQL cluster if it is not running, installing it when
# missing, and make sure role $1 (password = name) exists with CREATEDB.
ensure_postgres() {
  local role="$1"
  if ! command -v pg_ctlcluster >/dev/null; then
    say "PostgreSQL is not installed; installing it with apt-get"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
  fi
  if ! pg_lsclusters -h | grep -q "^$PG_VERSION main"; then
    PG_VERSION=$(pg_lsclusters -h | awk 'NR==1{print $1}')
    [ -n "$PG_VERSION" ] || { say "creating a PostgreSQL cluster"; pg_createcluster 15 main >/dev/null; PG_VERSION=15; }
  fi
  if ! pg_lsclusters -h | awk -v v="$PG_VERSION" '$1==v && $2=="main"{print $4}' | grep -q online; then
    say "starting PostgreSQL $PG_VERSION"
    pg_ctlcluster "$PG_VERSION" main start
    STARTED_POSTGRES=1
  fi
  wait_for_port 127.0.0.1 5432 30 || die "PostgreSQL did not open 127.0.0.1:5432 (see /var/log/postgresql/)"
  su postgres -c "psql -q -v ON_ERROR_STOP=1" <<SQL >/dev/null
DO \$\$ BEGIN
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '$role') THEN
    CREATE ROLE $role LOGIN CREATEDB PASSWORD '$role';
  END IF;
END \$\$;
SQL
}

# What a DBA does for applications that enqueue through relay.publish and
# relay.call: the enqueue role relay grants EXECUTE to, and a login role of
# an application in it (docs/applications.md, docs/security.md "Who may enqueue").
ensure_application_roles() {
  su postgres -c "psql -q -v ON_ERROR_STOP=1" <<SQL >/dev/null
DO \$\$ BEGIN
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'relay_enqueue') THEN
    CREATE ROLE relay_enqueue NOLOGIN;
  END IF;
  -- A second deployment's role, which relay_app is not in.
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'relay_enqueue_other') THEN
    CREATE ROLE relay_enqueue_other NOLOGIN;
  END IF;
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'relay_app') THEN
    CREATE ROLE relay_app LOGIN PASSWORD 'relay_app' IN ROLE relay_enqueue;
  END IF;
  -- A login in both deployments' roles, and a role it may SET ROLE to
  -- that is in the first only (the front door judges the role acted as).
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'relay_app_narrow') THEN
    CREATE ROLE relay_app_narrow NOLOGIN IN ROLE relay_enqueue;
  END IF;
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'relay_app_wide') THEN
    CREATE ROLE relay_app_wide LOGIN PASSWORD 'relay_app_wide' IN ROLE relay_enqueue_other, relay_app_narrow;
  END IF;
END \$\$;
SQL
}

# A Python with psycopg for the examples/python test, in $CACHE/python
# (once); exports RELAY_TEST_PYTHON.
ensure_python_example_deps() {
  local venv="$CACHE/python"
  # confluent-kafka with its Avro, JSON Schema and Protobuf serializers: an independent
  # writer (and reader) of the Schema Registry wire format for tests/e2e/registry.rs; protoc
  # from grpcio-tools compiles the tests' .proto files into Python classes;
  # openapi-spec-validator checks the admin API's OpenAPI description (tests/e2e/admin.rs);
  # kubernetes-validate checks the Helm chart's manifests against Kubernetes' schemas,
  # which it bundles (tests/e2e/helm.rs).
  if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import psycopg, confluent_kafka.schema_registry.avro, confluent_kafka.schema_registry.json_schema, confluent_kafka.schema_registry.protobuf, grpc_tools.protoc, openapi_spec_validator, kubernetes_validate' 2>/dev/null; then
    command -v python3 >/dev/null || die "Python 3 is needed for the examples/python test (apt-get install python3-venv)"
    say "installing the Python test dependencies (psycopg, confluent-kafka, protoc, validators) into $venv"
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv" || die "python3 -m venv failed (apt-get install python3-venv)"
    "$venv/bin/pip" install -q --disable-pip-version-check "psycopg[binary]==3.3.9" "confluent-kafka[avro,json,protobuf,schemaregistry]==2.16.0" \
      "protobuf==7.36.2" "grpcio-tools==1.85.1" "openapi-spec-validator==0.9.0" "kubernetes-validate==1.37.0" \
      || die "could not install the Python test dependencies from PyPI"
  fi
  export RELAY_TEST_PYTHON="$venv/bin/python"
}

# The Node, Go and Java examples' dependencies (pg, pgx, pgjdbc), built or
# fetched into the checkout and $CACHE (once); exports RELAY_TEST_GO_EXAMPLE
# and RELAY_TEST_JAVA_CLASSPATH. Every toolchain is on this machine kind.
ensure_example_deps() {
  command -v npm >/dev/null || die "npm is needed for examples/node (apt-get install npm)"
  command -v go >/dev/null || die "Go is needed for examples/go"
  command -v mvn >/dev/null || die "Maven is needed for examples/java"
  if [ ! -d "$ROOT/examples/node/node_modules/pg" ]; then
    say "installing pg for examples/node"
    (cd "$ROOT/examples/node" && npm ci --no-audit --no-fund --silent)
  fi
  mkdir -p "$CACHE/examples"
  say "building examples/go"
  (cd "$ROOT/examples/go" && go build -o "$CACHE/examples/enqueue-go" .)
  export RELAY_TEST_GO_EXAMPLE="$CACHE/examples/enqueue-go"
  if ! ls "$CACHE/examples/java-lib/"postgresql-*.jar >/dev/null 2>&1; then
    say "fetching pgjdbc for examples/java"
    (cd "$ROOT/examples/java" && mvn -q dependency:copy-dependencies -DoutputDirectory="$CACHE/examples/java-lib")
  fi
  export RELAY_TEST_JAVA_CLASSPATH
  RELAY_TEST_JAVA_CLASSPATH=$(ls "$CACHE/examples/java-lib/"*.jar | tr '\n' ':')
}

stop_postgres_if_started() {
  if [ -n "$STARTED_POSTGRES" ]; then
    say "stopping PostgreSQL (this script started it)"
    pg_ctlcluster "$PG_VERSION" main stop || true
  fi
}

# (Re)create database $2 owned by role $1.
fresh_database() {
  su postgres -c "psql -q -v ON_ERROR_STOP=1" <<SQL >/dev/null
DROP DATABASE IF EXISTS $2 WITH (FORCE);
CREATE DATABASE $2 OWNER $1;
SQL
}

# Fetch Apache Kafka's jars from Maven Central into $CACHE/kafka-libs (once).
# Verified here on 2026-11-30: kafka_2.13 4.4.0 resolves with Maven 3.8.7 and
# runs as a single KRaft node on OpenJDK 17 (see scripts/kafka/pom.xml).
fetch_kafka() {
  local libs="$CACHE/kafka-libs"
  local stamp="$libs/.complete-$(sha1sum "$ROOT/scripts/kafka/pom.xml" | cut -c1-12)"
  if [ ! -f "$stamp" ]; then
    command -v mvn >/dev/null || die "Maven (mvn) is needed to fetch Apache Kafka's jars; apt-get install maven"
    command -v java >/dev/null || die "Java 17+ is needed to run Apache Kafka; apt-get install openjdk-17-jre-headless"
    say "fetching Apache Kafka jars from Maven Central into $libs"
    rm -rf "$libs"; mkdir -p "$libs"
    mvn -q -B -f "$ROOT/scripts/kafka/pom.xml" dependency:copy-dependencies -DoutputDirectory="$libs" >&2 \
      || die "could not fetch Kafka's jars with Maven"
    touch "$stamp"
  fi
  echo "$libs"
}

# Start a single-node KRaft Apache Kafka broker in a fresh temp dir.
# Sets KAFKA_BOOTSTRAP, KAFKA_PID, KAFKA_DIR. Port: $1 or a free one.
start_kafka() {
  local libs port ctl
  libs=$(fetch_kafka)
  port="${1:-$(free_port)}"
  ctl=$(free_port)
  KAFKA_DIR=$(mktemp -d /tmp/relay-kafka.XXXXXX)
  cat >"$KAFKA_DIR/server.properties" <<PROPS
process.roles=broker,controller
node.id=1
controller.quorum.bootstrap.servers=127.0.0.1:$ctl
listeners=PLAINTEXT://127.0.0.1:$port,CONTROLLER://127.0.0.1:$ctl
advertised.listeners=PLAINTEXT://127.0.0.1:$port
controller.listener.names=CONTROLLER
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
inter.broker.listener.name=PLAINTEXT
log.dirs=$KAFKA_DIR/data
num.partitions=1
offsets.topic.replication.factor=1
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
group.initial.rebalance.delay.ms=0
auto.create.topics.enable=true
# Topics store snappy, whatever producers send: snappy inflates at most ~21
# times, and relay refuses input topics that keep zstd, gzip or lz4 batches.
compression.type=snappy
PROPS
  cp "$ROOT/scripts/kafka/log4j2.yaml" "$KAFKA_DIR/log4j2.yaml"
  local cluster_id
  # Never starting with '-' (the storage tool would take it for an option), as Kafka's own ids.
  cluster_id=$(python3 -c 'import uuid,base64
while True:
    i = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
    if not i.startswith("-"): break
print(i)')
  java -Xmx512m -cp "$libs/*" -Dlog4j2.configurationFile="$KAFKA_DIR/log4j2.yaml" -Dkafka.logs.dir="$KAFKA_DIR" \
    kafka.tools.StorageTool format --standalone -t "$cluster_id" -c "$KAFKA_DIR/server.properties" \
    >"$KAFKA_DIR/format.log" 2>&1 || { cat "$KAFKA_DIR/format.log" >&2; die "formatting Kafka storage failed"; }
  say "starting Apache Kafka on 127.0.0.1:$port (logs: $KAFKA_DIR/broker.log)"
  KAFKA_HEAP_OPTS= java -Xms256m -Xmx768m -XX:+UseG1GC -cp "$libs/*" \
    -Dlog4j2.configurationFile="$KAFKA_DIR/log4j2.yaml" -Dkafka.logs.dir="$KAFKA_DIR" \
    kafka.Kafka "$KAFKA_DIR/server.properties" >"$KAFKA_DIR/stdout.log" 2>&1 &
  KAFKA_PID=$!
  echo "$KAFKA_PID" >"$KAFKA_DIR/pid"
  local deadline=$((SECONDS + 90))
  until grep -q "Kafka Server started" "$KAFKA_DIR/broker.log" 2>/dev/null; do
    kill -0 "$KAFKA_PID" 2>/dev/null || { tail -50 "$KAFKA_DIR/stdout.log" "$KAFKA_DIR/broker.log" >&2 2>/dev/null; die "Kafka exited during start"; }
    [ $SECONDS -lt $deadline ] || { tail -50 "$KAFKA_DIR/broker.log" >&2; die "Kafka did not start within 90 s"; }
    sleep 0.3
  done
  KAFKA_BOOTSTRAP="127.0.0.1:$port"
  say "Kafka is up at $KAFKA_BOOTSTRAP"
}

stop_kafka() {
  if [ -n "$KAFKA_PID" ] && kill -0 "$KAFKA_PID" 2>/dev/null; then
    say "stopping Kafka"
    kill "$KAFKA_PID" 2>/dev/null || true
    local deadline=$((SECONDS + 20))
    while kill -0 "$KAFKA_PID" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
    kill -9 "$KAFKA_PID" 2>/dev/null || true
  fi
  [ -n "$KAFKA_DIR" ] && rm -rf "$KAFKA_DIR"
  KAFKA_PID=""
}

# A Java 21+ for Apicurio Registry 3.3, if the machine has one (Temurin on
# some machine kinds); empty otherwise, and 3.0 runs on Java 17.
java21() {
  local j
  for j in "${JAVA21_HOME:-}" /usr/lib/jvm/temurin-25-jdk-amd64 /usr/lib/jvm/temurin-21-jdk-amd64 /usr/lib/jvm/java-21-openjdk-amd64; do
    if [ -n "$j" ] && [ -x "$j/bin/java" ]; then echo "$j/bin/java"; return; fi
  done
  if java -version 2>&1 | grep -qE 'version "(2[1-9]|[3-9][0-9])'; then command -v java; fi
}

# A real Confluent-compatible Schema Registry: Apicurio Registry from Maven
# Central (Confluent's own is not published there), its ccompat API on
# loopback, in memory. Fetched and unpacked into $CACHE once. Sets
# SCHEMA_REGISTRY_URL and REGISTRY_PID.
start_schema_registry() {
  command -v mvn >/dev/null || die "Maven (mvn) is needed to fetch Apicurio Registry; apt-get install maven"
  local java version jar dir port mgmt
  java=$(java21)
  if [ -n "$java" ]; then version=3.3.3; jar=quarkus-run.jar; else java=java; version=3.0.9; jar=apicurio-registry-app-3.0.9-runner.jar; fi
  dir="$CACHE/apicurio-registry-$version"
  if [ ! -f "$dir/.complete" ]; then
    say "fetching Apicurio Registry $version from Maven Central into $dir"
    rm -rf "$dir"; mkdir -p "$dir"
    # The dependency plugin 2.8: 3.x looks for a parent pom 3.0.9 does not publish.
    mvn -B -q -Dstyle.color=never org.apache.maven.plugins:maven-dependency-plugin:2.8:get -Dtransitive=false \
      -Dartifact="io.apicurio:apicurio-registry-app:$version:tar.gz:all" -Ddest="$dir/app.tar.gz" >&2 \
      || die "could not fetch Apicurio Registry $version with Maven"
    tar xzf "$dir/app.tar.gz" -C "$dir" && rm -f "$dir/app.tar.gz" || die "could not unpack Apicurio Registry"
    touch "$dir/.complete"
  fi
  local run; run=$(find "$dir" -maxdepth 2 -name "$jar" | head -1)
  [ -n "$run" ] || die "no $jar in $dir (remove it to fetch again)"
  port=$(free_port); mgmt=$(free_port)
  local log; log=$(mktemp /tmp/relay-registry.XXXXXX.log)
  say "starting Apicurio Registry $version on 127.0.0.1:$port (logs: $log)"
  # Both ports on loopback: the management port defaults to 0.0.0.0.
  (cd "$(dirname "$run")" && exec "$java" -Xms64m -Xmx256m -XX:+UseSerialGC -XX:TieredStopAtLevel=1 \
    -Dquarkus.http.host=127.0.0.1 -Dquarkus.http.port="$port" \
    -Dquarkus.management.host=127.0.0.1 -Dquarkus.management.port="$mgmt" \
    -Dquarkus.http.access-log.enabled=false -jar "$run") >"$log" 2>&1 &
  REGISTRY_PID=$!
  SCHEMA_REGISTRY_URL="http://127.0.0.1:$port/apis/ccompat/v7"
  local deadline=$((SECONDS + 120))
  until curl -sf "$SCHEMA_REGISTRY_URL/subjects" >/dev/null 2>&1; do
    kill -0 "$REGISTRY_PID" 2>/dev/null || { tail -40 "$log" >&2; die "Apicurio Registry exited during start"; }
    [ $SECONDS -lt $deadline ] || { tail -40 "$log" >&2; die "Apicurio Registry did not answer within 120 s"; }
    sleep 0.5
  done
  # Confluent's default; Apicurio's is NONE.
  curl -sf -X PUT -H 'Content-Type: application/json' -d '{"compatibility":"BACKWARD"}' "$SCHEMA_REGISTRY_URL/config" >/dev/null \
    || die "could not set the registry's compatibility to BACKWARD"
  say "Schema Registry is up at $SCHEMA_REGISTRY_URL"
}

stop_schema_registry() {
  if [ -n "$REGISTRY_PID" ] && kill -0 "$REGISTRY_PID" 2>/dev/null; then
    say "stopping Apicurio Registry"
    kill "$REGISTRY_PID" 2>/dev/null || true
    local deadline=$((SECONDS + 20))
    while kill -0 "$REGISTRY_PID" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
    kill -9 "$REGISTRY_PID" 2>/dev/null || true
  fi
  REGISTRY_PID=""
}

# Helm for tests/e2e/helm.rs, built from its Go module once into $CACHE/bin: the Go
# module proxy is reachable where Helm's release downloads are not.
HELM_VERSION=v4.3.2
ensure_helm() {
  local bin="$CACHE/bin/helm-$HELM_VERSION"
  if [ ! -x "$bin" ]; then
    command -v go >/dev/null || die "Go is needed to build Helm for the chart test (tests/e2e/helm.rs); install Go 1.26"
    say "building Helm $HELM_VERSION from its Go module into $CACHE/bin (about 2 minutes, once)"
    mkdir -p "$CACHE/bin/build"
    GOBIN="$CACHE/bin/build" go install "helm.sh/helm/v4/cmd/helm@$HELM_VERSION" \
      || die "could not build Helm: go install helm.sh/helm/v4/cmd/helm@$HELM_VERSION failed"
    mv "$CACHE/bin/build/helm" "$bin"
  fi
  export RELAY_TEST_HELM="$bin"
}

# PostgreSQL (started if needed) + a fresh Apache Kafka broker for tests and
# the soak; exports RELAY_TEST_* and installs a cleanup trap.
start_test_services() {
  TEST_ROLE=relay_test
  ensure_postgres "$TEST_ROLE"
  ensure_application_roles
  ensure_python_example_deps
  ensure_example_deps
  ensure_helm
  export RELAY_TEST_DATABASE_URL="postgres://$TEST_ROLE:$TEST_ROLE@127.0.0.1:5432/postgres"
  export RELAY_TEST_APP_DATABASE_URL="postgres://relay_app:relay_app@127.0.0.1:5432/postgres"
  start_kafka
  export RELAY_TEST_KAFKA_BOOTSTRAP="$KAFKA_BOOTSTRAP"
  export RELAY_TEST_KAFKA_LIBS="$CACHE/kafka-libs"   # for tests that run a broker of their own
  trap cleanup_test_services EXIT INT TERM
  start_schema_registry
  export RELAY_TEST_SCHEMA_REGISTRY_URL="$SCHEMA_REGISTRY_URL"
}

cleanup_test_services() {
  local rc=$?
  stop_schema_registry
  stop_kafka
  # Drop the databases tests and soaks created.
  su postgres -c "psql -qAt -c \"SELECT datname FROM pg_database WHERE datname LIKE 'relay_test_%'\"" 2>/dev/null |
    while read -r db; do su postgres -c "psql -q -c 'DROP DATABASE IF EXISTS \"$db\" WITH (FORCE)'" >/dev/null 2>&1 || true; done
  stop_postgres_if_started
  exit $rc
}

# Headless Chromium (Debian's package) and playwright-core for the console test.
ensure_console_test_deps() {
  if ! command -v chromium >/dev/null; then
    say "installing Debian's chromium for the console test"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  fi
  command -v node >/dev/null || die "Node.js is needed for the console test (apt-get install nodejs)"
  if [ ! -d "$ROOT/tests/console/node_modules/playwright-core" ]; then
    say "installing playwright-core for the console test"
    (cd "$ROOT/tests/console" && npm ci --no-audit --no-fund --silent)
  fi
}
