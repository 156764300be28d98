"""Bytes on the wire: tensors with their CRC-32s, large protobuf chunks without copies, and
policy-version deltas."""
