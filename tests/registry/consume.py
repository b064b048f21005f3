"""Read records relay emitted with Confluent's own deserializers
(confluent-kafka from PyPI): the independent check that relay writes the
Schema Registry wire format.

usage: consume.py avro|json|protobuf BOOTSTRAP REGISTRY_URL TOPIC COUNT [SCHEMA_FILE]

For protobuf, SCHEMA_FILE says which message class reads the records, as in
produce.py; the message is printed with its .proto field names. The
deserializer is given no registry client: with one it asks for schemas in
`format=serialized`, which Apicurio Registry answers wrongly (HTTP 500 or
.proto text), so the test compares the schema id printed here instead.

Prints one JSON object per record: {"key", "content_type", "schema_id", "value"}, with
decimals as text and dates and times in ISO 8601. Fails after 60 s without
COUNT records.
"""

import datetime
import decimal
import json
import sys
import time
import uuid

from confluent_kafka import Consumer
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.schema_registry.json_schema import JSONDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext

from protos import message_class


def plain(value):
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, (datetime.date, datetime.datetime, datetime.time)):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.hex()
    return value


def message_indexes(value: bytes) -> list:
    """The message indexes after the 5-byte header, read here (zig-zag
    varints, a single 0 for [0]): without a registry client the deserializer
    skips them and reads with its own class."""
    pos = 5

    def varint():
        nonlocal pos
        shift, result = 0, 0
        while True:
            b = value[pos]
            pos += 1
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return (result >> 1) ^ -(result & 1)
            shift += 7

    count = varint()
    return [0] if count == 0 else [varint() for _ in range(count)]


def main() -> None:
    fmt, bootstrap, registry_url, topic, count = sys.argv[1:6]
    registry = SchemaRegistryClient({"url": registry_url})
    if fmt == "avro":
        deserialize = AvroDeserializer(registry)
    elif fmt == "protobuf":
        from confluent_kafka.schema_registry.protobuf import ProtobufDeserializer
        from google.protobuf import json_format

        with open(sys.argv[6], encoding="utf-8") as f:
            proto = ProtobufDeserializer(message_class(json.load(f)), {}, None)

        def deserialize(value, ctx):
            return json_format.MessageToDict(
                proto(value, ctx), preserving_proto_field_name=True, always_print_fields_with_no_presence=True
            )
    else:
        deserialize = JSONDeserializer(None, schema_registry_client=registry)
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": f"reader-{uuid.uuid4()}", "auto.offset.reset": "earliest"}
    )
    consumer.subscribe([topic])
    seen, deadline = 0, time.monotonic() + 60
    while seen < int(count):
        if time.monotonic() > deadline:
            sys.exit(f"only {seen} of {count} records on {topic} within 60 s")
        msg = consumer.poll(1.0)
        if msg is None:
            continue
        if msg.error():
            sys.exit(f"consume error: {msg.error()}")
        headers = dict((k, v.decode()) for k, v in (msg.headers() or []) if v is not None)
        value = deserialize(msg.value(), SerializationContext(topic, MessageField.VALUE))
        schema_id = int.from_bytes(msg.value()[1:5], "big")
        print(
            json.dumps(
                {
                    "key": msg.key().decode(),
                    "content_type": headers.get("content-type"),
                    "schema_id": schema_id,
                    "message_indexes": message_indexes(msg.value()) if fmt == "protobuf" else None,
                    "value": plain(value),
                }
            )
        )
        seen += 1
    consumer.close()


if __name__ == "__main__":
    main()
