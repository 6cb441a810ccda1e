"""Workloads: requests, their arrival processes and contents, and the open-loop load client.

The generators (`arrivals`, `traces`, `generate`) and `metrics` are plain data and numpy, and the
router's simulator draws from them; `replay` alone uses the transport, to drive a live server.
"""

from workloads.request import Message, Request, TokenIds

__all__ = ["Message", "Request", "TokenIds"]
