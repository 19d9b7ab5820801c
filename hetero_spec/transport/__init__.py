"""Wire protocol (protocol.py) and ZeroMQ channel (channel.py). Knows neither torch nor onnxruntime."""
