"""Producer side: submit prompts, stream tokens, fetch results. Imports no torch, loads no weights."""

from tokenfleet.producer.aio import AsyncClient, AsyncHandle
from tokenfleet.producer.client import Client, Handle
from tokenfleet.producer.result import Chunk, Result

__all__ = ["AsyncClient", "AsyncHandle", "Chunk", "Client", "Handle", "Result"]
