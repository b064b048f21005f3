"""Produce records with Confluent's own serializers (confluent-kafka from
PyPI), so relay's decoding is checked against an independent implementation
of the Schema Registry wire format.

usage: produce.py avro|json BOOTSTRAP REGISTRY_URL TOPIC SCHEMA_FILE RECORDS_JSON

RECORDS_JSON is a JSON list of {"key": ..., "value": {...}} objects; each
value is serialized with the schema in SCHEMA_FILE, registered under the
subject TOPIC-value (topic name strategy). A field given as
{"$decimal": "12.50"} is a decimal.Decimal (JSON has none). Prints the
schema id used.
"""

import decimal
import json
import sys

from confluent_kafka import Producer
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.schema_registry.json_schema import JSONSerializer
from confluent_kafka.serialization import MessageField, SerializationContext


def main() -> None:
    fmt, bootstrap, registry_url, topic, schema_file, records_json = sys.argv[1:7]
    with open(schema_file, encoding="utf-8") as f:
        schema = f.read()
    registry = SchemaRegistryClient({"url": registry_url})
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

    for record in json.loads(records_json):
        value = serialize(hydrate(record["value"]), SerializationContext(topic, MessageField.VALUE))
        producer.produce(topic, key=record["key"].encode(), value=value, on_delivery=delivered)
    left = producer.flush(30)
    if left or failures:
        sys.exit(f"{left} records not delivered; failures: {failures}")
    print(int.from_bytes(value[1:5], "big"))


if __name__ == "__main__":
    main()
