"""ONNX models as sharedml reads them.

The protobuf messages, the one table of tensor element types, the one walk over a model's
tensors and its external data, input specs, and the tables that inputs index.
"""
