"""The gateway's plain ASGI middleware: bounds on bodies (``limits``), trace context (``traces``)."""
