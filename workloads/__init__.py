"""Workloads: requests and their arrival processes. The bottom of the import graph, after config."""

from workloads.request import Message, Request

__all__ = ["Message", "Request"]
