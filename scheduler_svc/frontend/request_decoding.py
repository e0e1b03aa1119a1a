"""Decode request bytes ourselves, so a malformed request is INVALID_ARGUMENT that names the field.

With the stock deserializer, invalid UTF-8 in a string field fails inside grpc and the client
sees INTERNAL; and a oneof whose members are both on the wire silently keeps the last one. Both
are the client's mistakes. A short walk over the wire format finds them first.
"""
from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message


@dataclass
class MalformedRequest:
    """Returned by the deserializer instead of a message; the handler answers INVALID_ARGUMENT."""
    message: str


def decode_request(message_cls: type[Message], data: bytes) -> Message | MalformedRequest:
    problem = wire_problem(message_cls.DESCRIPTOR, data)
    if problem is not None:
        return MalformedRequest(problem)
    try:
        return message_cls.FromString(data)
    except DecodeError as exc:
        return MalformedRequest(f"cannot parse {message_cls.DESCRIPTOR.name}: {exc}")


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("truncated or overlong varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def wire_problem(desc: Descriptor, data: bytes, path: str = "") -> str | None:
    """The first string field with invalid UTF-8, or oneof set twice, as a message; None if clean."""
    pos, counts, oneof_seen = 0, {}, {}
    try:
        while pos < len(data):
            key, pos = _varint(data, pos)
            number, wire_type = key >> 3, key & 7
            payload = None
            if wire_type == 0:
                _, pos = _varint(data, pos)
            elif wire_type == 1:
                pos += 8
            elif wire_type == 5:
                pos += 4
            elif wire_type == 2:
                length, pos = _varint(data, pos)
                payload, pos = data[pos:pos + length], pos + length
            else:
                raise ValueError(f"unsupported wire type {wire_type}")
            if pos > len(data):
                raise ValueError("truncated field")
            field = desc.fields_by_number.get(number)
            if field is None:
                continue  # unknown fields are kept and ignored, as protobuf does
            name = path + field.name
            if field.is_repeated:
                counts[number] = counts.get(number, -1) + 1
                name += f"[{counts[number]}]"
            oneof = field.containing_oneof
            if oneof is not None:
                first = oneof_seen.setdefault(oneof.name, field.name)
                if first != field.name:
                    members = ", ".join(path + f.name for f in oneof.fields)
                    return f"set only one of {members}; got {path + first} and {name}"
            if payload is None:
                continue
            if field.type == FieldDescriptor.TYPE_STRING:
                try:
                    payload.decode("utf-8")
                except UnicodeDecodeError as exc:
                    return f"{name} is not valid UTF-8 (byte {exc.start})"
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                problem = wire_problem(field.message_type, payload, name + ".")
                if problem is not None:
                    return problem
    except ValueError as exc:
        return f"cannot parse {desc.name}{' at ' + path.rstrip('.') if path else ''}: {exc}"
    return None
