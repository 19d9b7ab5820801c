"""Wire protocol and ZeroMQ channel. Knows neither torch nor onnxruntime."""

from .channel import Channel, CurveKeys
from .protocol import MalformedMessage, decode, encode

__all__ = ["Channel", "CurveKeys", "MalformedMessage", "decode", "encode"]
