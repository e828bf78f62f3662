"""Rows that share a prefix, merged into one tree: :func:`build_prefix_tree` -> :class:`PrefixTree`.

An agent's transitions repeat themselves: every call of a GRPO group starts with the same system prompt, tools and
question, and an episode's second call starts with its first call's prompt and response. Run as separate rows, a
forward pass computes those shared tokens once per row. Merged into a trie (one node per distinct prefix), each
is computed once: the tree is run as ONE packed row of its ``N`` nodes in depth-first (preorder) order, each node at
position ``depth`` (its index in its sequence), attending to exactly its ancestors and itself. A causal model's
state at a token depends only on the tokens before it and their positions, so every node's state equals the state
of that token in each row that passes through it (up to float rounding), and the gradient of a loss on the rows'
tokens is the same: autograd sums the contributions of every row through a shared node.

Preorder numbering makes the mask a pair of comparisons: node ``j``'s subtree is the preorder interval
``[j, subtree_end[j])``, so ``j`` is an ancestor-or-self of ``i`` iff ``j <= i < subtree_end[j]``.

Imports only torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["PrefixTree", "build_prefix_tree"]


@dataclass(frozen=True)
class PrefixTree:
    """The real tokens of ``B`` right-padded rows, merged where rows share a prefix.

    ``token_ids [N]`` long: each node's token, in preorder. ``depth [N]`` long: each node's position in its
    sequences (0 for a first token). ``subtree_end [N]`` long: one past the last node of each node's subtree.
    ``node_of [B, T]`` long: the node of each real token of each row, -1 on padding.
    """

    token_ids: Tensor
    depth: Tensor
    subtree_end: Tensor
    node_of: Tensor

    @property
    def size(self) -> int:
        """Nodes (N): the tokens a forward pass over the tree computes."""
        return int(self.token_ids.shape[0])

    def attention_mask(self) -> Tensor:
        """``[N, N]`` bool, True where node i (row) may attend to node j (column): j is i or one of its ancestors."""
        index = torch.arange(self.size, device=self.token_ids.device)
        return (index[None, :] <= index[:, None]) & (index[:, None] < self.subtree_end[None, :])


def build_prefix_tree(input_ids: Tensor, attention_mask: Tensor) -> PrefixTree:
    """The prefix tree of the rows of ``input_ids [B, T]`` (right-padded: each row's real tokens, where
    ``attention_mask`` is 1, come first). Children keep the order in which rows first reach them."""
    lengths = attention_mask.sum(dim=-1).tolist()
    rows = input_ids.tolist()
    children: list[dict[int, int]] = [{}]  # node 0: a virtual root above every first token
    tokens: list[int] = [-1]
    paths: list[list[int]] = []
    for row, length in zip(rows, lengths, strict=True):
        node, path = 0, []
        for token in row[:length]:
            child = children[node].get(token)
            if child is None:
                child = len(tokens)
                tokens.append(token)
                children.append({})
                children[node][token] = child
            node = child
            path.append(child)
        paths.append(path)
    order, depth, end = _preorder(children)
    rank = [0] * len(tokens)  # trie node -> preorder index (the root is not numbered)
    for index, node in enumerate(order):
        rank[node] = index
    width = input_ids.shape[1]
    node_of = torch.full((len(rows), width), -1, dtype=torch.long)
    for row, path in enumerate(paths):
        if path:
            node_of[row, : len(path)] = torch.tensor([rank[node] for node in path], dtype=torch.long)
    device = input_ids.device
    return PrefixTree(
        token_ids=torch.tensor([tokens[node] for node in order], dtype=torch.long, device=device),
        depth=torch.tensor(depth, dtype=torch.long, device=device),
        subtree_end=torch.tensor(end, dtype=torch.long, device=device),
        node_of=node_of.to(device),
    )


def _preorder(children: list[dict[int, int]]) -> tuple[list[int], list[int], list[int]]:
    """The trie's nodes below the virtual root 0 in preorder, each one's depth, and each one's subtree end (one
    past the preorder index of its last descendant)."""
    order: list[int] = []
    depth: list[int] = []
    end: list[int] = []
    stack: list[tuple[int, int, bool]] = [(child, 0, False) for child in reversed(children[0].values())]
    open_at: dict[int, int] = {}
    while stack:
        node, level, closing = stack.pop()
        if closing:
            end[open_at.pop(node)] = len(order)
            continue
        open_at[node] = len(order)
        order.append(node)
        depth.append(level)
        end.append(0)
        stack.append((node, level, True))
        stack.extend((child, level + 1, False) for child in reversed(children[node].values()))
    return order, depth, end
