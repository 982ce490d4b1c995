"""TensorBoard event files read back without TensorBoard (TFRecord framing, tensorboardX's protos)."""

import struct


def event_scalars(paths):
    """{(tag, step): value} of the scalar summaries in TFRecord event files."""
    from tensorboardX.proto import event_pb2

    out = {}
    for path in paths:
        data = open(path, "rb").read()
        i = 0
        while i < len(data):
            (length,) = struct.unpack("<Q", data[i : i + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[i + 12 : i + 12 + length])
            i += 12 + length + 4
            for v in event.summary.value:
                out[(v.tag, event.step)] = v.simple_value
    return out
