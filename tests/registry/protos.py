"""Message classes from .proto text, compiled with protoc (grpcio-tools from
PyPI): the producer and consumer scripts use Python's own Protobuf stack, not
relay's, to write and read records."""

import importlib
import os
import sys
import tempfile


def message_class(spec: dict):
    """The class of spec["message"] (a full name) declared in spec["file"],
    one of spec["files"] ({name: .proto text})."""
    from grpc_tools import protoc

    out = tempfile.mkdtemp(prefix="relay-protos-")
    for name, text in spec["files"].items():
        os.makedirs(os.path.dirname(os.path.join(out, name)), exist_ok=True)
        with open(os.path.join(out, name), "w", encoding="utf-8") as f:
            f.write(text)
    args = ["protoc", f"-I{out}", f"-I{os.path.join(os.path.dirname(protoc.__file__), '_proto')}", f"--python_out={out}"]
    if protoc.main(args + list(spec["files"])) != 0:
        sys.exit(f"protoc could not compile {list(spec['files'])}")
    sys.path.insert(0, out)
    module = importlib.import_module(spec["file"].removesuffix(".proto").replace("/", ".") + "_pb2")
    cls = module
    for part in spec["message"].split(".")[len(module.DESCRIPTOR.package.split(".")) if module.DESCRIPTOR.package else 0 :]:
        cls = getattr(cls, part)
    return cls
