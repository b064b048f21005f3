"""Produce records with Confluent's own serializers (confluent-kafka from
PyPI), so relay's decoding is checked against an independent implementation
of the Schema Registry wire format.

usage: produce.py avro|json|protobuf BOOTSTRAP REGISTRY_URL TOPIC SCHEMA_FILE RECORDS_JSON

RECORDS_JSON is a JSON list of {"key": ..., "value": {...}} objects; each
value is serialized with the schema in SCHEMA_FILE, registered under the
subject TOPIC-value (topic name strategy). A field given as
{"$decimal": "12.50"} is a decimal.Decimal (JSON has none). Prints the
schema id used.

For protobuf, SCHEMA_FILE holds {"files": {name: .proto text}, "file": name,
"message": name}: the files are compiled with protoc (grpcio-tools) and the
serializer registers them as it does in production, imports as references.
For avro and json, SCHEMA_FILE may instead hold {"schema": text,
"references": [{"name", "subject", "version"}]}: a schema using types (for
JSON Schema, `$ref`s by name) of schemas already registered (schema
references).

With RECORDS_JSON "[]" the schema is only registered (for a topic relay
writes), and its id printed.
"""

import decimal
import json
import sys

from confluent_kafka import Producer
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.schema_registry.json_schema import JSONSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from protos import message_class


def main() -> None:
    fmt, bootstrap, registry_url, topic, schema_file, records_json = sys.argv[1:7]
    with open(schema_file, encoding="utf-8") as f:
        schema = f.read()
    registry = SchemaRegistryClient({"url": registry_url})
    if fmt == "protobuf":
        from confluent_kafka.schema_registry.protobuf import ProtobufSerializer
        from google.protobuf import json_format

        cls = message_class(json.loads(schema))
        proto = ProtobufSerializer(cls, registry, {"auto.register.schemas": True})

        def serialize(value, ctx):
            return proto(json_format.ParseDict(value, cls()), ctx)
    elif fmt in ("avro", "json") and '"references"' in schema and "schema" in json.loads(schema):
        from confluent_kafka.schema_registry import Schema, SchemaReference

        spec = json.loads(schema)
        refs = [SchemaReference(r["name"], r["subject"], r["version"]) for r in spec["references"]]
        serializer, kind = (AvroSerializer, "AVRO") if fmt == "avro" else (JSONSerializer, "JSON")
        serialize = serializer(
            schema_registry_client=registry,
            schema_str=Schema(spec["schema"], kind, refs),
            conf={"auto.register.schemas": True},
        )
    else:
        serializers = {"avro": AvroSerializer, "json": JSONSerializer}
        serialize = serializers[fmt](
            schema_registry_client=registry, schema_str=schema, conf={"auto.register.schemas": True}
        )
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    failures = []

    def delivered(err, _msg):
        if err is not None:
            failures.append(str(err))

    def hydrate(value):
        if isinstance(value, dict):
            if list(value) == ["$decimal"]:
                return decimal.Decimal(value["$decimal"])
            return {k: hydrate(v) for k, v in value.items()}
        if isinstance(value, list):
            return [hydrate(v) for v in value]
        return value

    records = json.loads(records_json)
    if not records:
        # Registering is what serializing does first; nothing is produced.
        value = serialize({} if fmt == "protobuf" else None, SerializationContext(topic, MessageField.VALUE))
        print(int.from_bytes(value[1:5], "big"))
        return
    for record in records:
        value = serialize(hydrate(record["value"]), SerializationContext(topic, MessageField.VALUE))
        producer.produce(topic, key=record["key"].encode(), value=value, on_delivery=delivered)
    left = producer.flush(30)
    if left or failures:
        sys.exit(f"{left} records not delivered; failures: {failures}")
    print(int.from_bytes(value[1:5], "big"))


if __name__ == "__main__":
    main()
