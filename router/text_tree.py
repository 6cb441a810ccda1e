"""A character-level radix tree shared by several tenants (replicas), as sglang-router's
`cache_aware` policy keeps one per model (sgl-model-gateway 0.3.2, `src/policies/tree.rs`).

Each node holds a run of characters and the tenants whose requests passed through it, each with
the epoch it was last touched at (a global counter, not a clock). A tenant present at a node is
present at all its ancestors, so a tenant's "own tree" is the nodes that name it. A match walks
from the root and stops inside the first node that differs; the tenant it answers with is the
one that created the deepest node reached, where it is still there. Eviction trims a tenant's
least recently touched leaves until its characters fit a bound. The quirks kept from the
original (new tenants on a node start at epoch 0; a match touches its node one time in eight)
decide only the eviction order.

Written here rather than taken from a library: the policy it serves is a copy of sglang's, and
its tie-breaks (the creator of a node) are part of what is copied.
"""

from __future__ import annotations

import heapq
import itertools


class _Node:
    __slots__ = ("children", "owner", "parent", "tenants", "text")

    def __init__(
        self, text: str, parent: _Node | None, tenants: dict[int, int], owner: int | None
    ) -> None:
        self.text = text
        self.parent = parent
        self.children: dict[str, _Node] = {}
        self.tenants = tenants
        """tenant -> the epoch it last touched this node."""
        self.owner = owner
        """The tenant that created this text (sglang's `last_tenant`), kept across splits."""


def shared_prefix(a: str, b: str) -> int:
    """How many leading characters `a` and `b` share: slices compared in C, halving the range,
    where a loop over characters would cost a Python step each."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class TextTree:
    def __init__(self) -> None:
        self.root = _Node("", None, {}, None)
        self.chars: dict[int, int] = {}
        """Characters each tenant holds: the sum of its nodes' lengths."""
        self._epochs = itertools.count()

    def match(self, text: str) -> tuple[int, int | None]:
        """The longest prefix of `text` any tenant holds, in characters, and the tenant that
        answers for it (None where the node reached has none; any tenant for no match at all,
        as sglang answers from its root)."""
        node, matched, rest = self.root, 0, text
        while rest:
            child = node.children.get(rest[0])
            if child is None:
                break
            shared = shared_prefix(rest, child.text)
            matched += shared
            node = child
            if shared < len(child.text):
                break
            rest = rest[shared:]
        tenant = node.owner if node.owner in node.tenants else next(iter(node.tenants), None)
        epoch = next(self._epochs)
        if tenant is not None and epoch % 8 == 0:
            node.tenants[tenant] = epoch
        return matched, tenant

    def insert(self, text: str, tenant: int) -> None:
        """`tenant` holds `text` now: every node on its path names it."""
        node = self.root
        node.tenants.setdefault(tenant, 0)
        self.chars.setdefault(tenant, 0)
        rest = text
        while rest:
            child = node.children.get(rest[0])
            if child is None:
                leaf = _Node(rest, node, {tenant: next(self._epochs)}, tenant)
                node.children[rest[0]] = leaf
                self.chars[tenant] += len(rest)
                return
            shared = shared_prefix(rest, child.text)
            if shared < len(child.text):
                child = self._split(node, child, shared)
            if tenant not in child.tenants:
                child.tenants[tenant] = 0
                self.chars[tenant] += len(child.text)
            node, rest = child, rest[shared:]
        node.tenants[tenant] = next(self._epochs)

    def _split(self, parent: _Node, child: _Node, at: int) -> _Node:
        """Cut `child`'s text at `at`: a new node with the head, `child` below it with the tail.
        Tenants' character counts do not change."""
        head = _Node(child.text[:at], parent, dict(child.tenants), child.owner)
        child.text = child.text[at:]
        child.parent = head
        head.children[child.text[0]] = child
        parent.children[head.text[0]] = head
        return head

    def evict(self, max_chars: int) -> None:
        """Trim every tenant holding more than `max_chars` characters, least recently touched
        leaf (of that tenant's own tree) first."""
        for tenant in [t for t, n in self.chars.items() if n > max_chars]:
            order = itertools.count()  # ties (new tenants share epoch 0) in the walk's order
            heap = [(node.tenants[tenant], next(order), node) for node in self._leaves_of(tenant)]
            heapq.heapify(heap)
            while heap and self.chars[tenant] > max_chars:
                _, _, node = heapq.heappop(heap)
                del node.tenants[tenant]
                self.chars[tenant] -= len(node.text)
                parent = node.parent
                if not node.tenants and not node.children and parent is not None:
                    del parent.children[node.text[0]]
                if parent is not None and parent is not self.root and self._leaf_of(parent, tenant):
                    heapq.heappush(heap, (parent.tenants[tenant], next(order), parent))

    def remove(self, tenant: int) -> None:
        """Take `tenant` out of every node (a replica gone)."""
        for node in self._leaves_of(tenant, everywhere=True):
            del node.tenants[tenant]
            if not node.tenants and not node.children and node.parent is not None:
                del node.parent.children[node.text[0]]
        self.root.tenants.pop(tenant, None)
        self.chars.pop(tenant, None)

    def _leaf_of(self, node: _Node, tenant: int) -> bool:
        return tenant in node.tenants and not any(
            tenant in child.tenants for child in node.children.values()
        )

    def _leaves_of(self, tenant: int, everywhere: bool = False) -> list[_Node]:
        """The nodes where `tenant`'s own tree ends, or with `everywhere` all its nodes, deepest
        first, the root left out."""
        found: list[_Node] = []
        stack = [self.root]
        order: list[_Node] = []
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(c for c in node.children.values() if tenant in c.tenants)
        for node in reversed(order):
            if node is not self.root and (everywhere or self._leaf_of(node, tenant)):
                found.append(node)
        return found
