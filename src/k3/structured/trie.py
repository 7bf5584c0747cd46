"""The vocabulary's byte strings as a trie, flattened in preorder, for walking every token from a state.

Node 0 is the root (the empty string); node i > 0 stands for a byte string whose last byte is byte[i] and
whose parent is the last node before i at depth[i] - 1. Preorder makes two things one jump each (the
layout of llguidance's toktrie): a node's subtree is the run of nodes i … end[i] - 1, so a branch the
grammar refuses is skipped whole; and the tokens at or below node i are one run order[first[i] :
first[end[i]]] of the tokens listed in preorder, so a branch the grammar accepts whole is one range.
"""

import torch


class TokenTrie:
    """Built from token_bytes (index = token id; None or b"" for ids that are not byte strings).

    byte, depth, end, first: per node, tuples of ints (the walk reads them one by one, where Python
    sequences are fastest); first has one more entry, first[N] = T. below[i]: a 256-bit int with bit b set when byte b
    occurs at node i or in its subtree; height[i]: how many bytes deep the subtree goes, node i's own
    included (1 for a leaf). order: (T,) int64 token ids in preorder (tokens with the same bytes next to
    each other).
    """

    def __init__(self, token_bytes: list[bytes | None]) -> None:
        pairs = sorted((b, i) for i, b in enumerate(token_bytes) if b)
        byte, depth, end, first, parent = [-1], [0], [0], [0], [-1]
        order: list[int] = []
        path = [0]  # the nodes of the previous token's bytes, root first
        previous = b""
        for data, token in pairs:
            if data != previous:
                common = 0
                while common < min(len(data), len(previous)) and data[common] == previous[common]:
                    common += 1
                while len(path) > common + 1:
                    end[path.pop()] = len(byte)
                for d in range(common, len(data)):
                    parent.append(path[-1])
                    path.append(len(byte))
                    byte.append(data[d])
                    depth.append(d + 1)
                    end.append(0)
                    first.append(len(order))
                previous = data
            order.append(token)
        for node in path:
            end[node] = len(byte)
        first.append(len(order))
        below, deepest = [0] * len(byte), depth[:]
        for i in range(len(byte) - 1, 0, -1):
            below[i] |= 1 << byte[i]
            below[parent[i]] |= below[i]
            deepest[parent[i]] = max(deepest[parent[i]], deepest[i])
        # tuples, not lists: a tuple of ints drops out of the garbage collector's tracking, where six lists of
        # 600K entries (a 164K vocabulary) would be scanned by every full collection, tens of ms each time
        self.byte, self.depth, self.end, self.first = tuple(byte), tuple(depth), tuple(end), tuple(first)
        self.below = tuple(below)
        self.height = tuple(d - depth[i] + 1 for i, d in enumerate(deepest))
        self.order = torch.tensor(order, dtype=torch.int64)
        self.max_depth = max(depth)

    @property
    def num_nodes(self) -> int:
        return len(self.byte)

    @property
    def num_tokens(self) -> int:
        return len(self.order)
