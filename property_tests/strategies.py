"""Hypothesis strategies for rollout sets that share prefixes.

Every strategy here draws a rollout set: a non-empty ``list[list[int]]`` of
token sequences, each of length 1..``max_len``, at most ``max_sequences`` of
them, tokens in ``[0, vocab_size)``. The sets are shaped like RL batches
(shared prompts, branching responses, multi-turn samples that are prefixes of
each other) and also cover the corner cases of a prefix tree:

- :func:`random_trie_rollouts`: a random trie, rollouts are root-to-node paths
  (so some rollouts end inside another one's path).
- :func:`deep_chains`: prefixes of one long chain (multi-turn samples).
- :func:`wide_fans`: one shared prefix, many sibling branches.
- :func:`with_duplicates`: some rollouts repeated verbatim.
- :func:`prefix_of_another`: a rollout and a proper prefix of it, among others.
- :func:`length_one_sequences`: every rollout is one token.
- :func:`forests`: several trees with distinct first tokens.
- :func:`vocab_edge_rollouts`: only the token ids 0 and ``vocab_size - 1``.

:func:`rollout_sets` mixes all of them and is the one to use by default. The
order of the rollouts is shuffled, so tests also see unsorted input.

Defaults are small on purpose: the float64 reference builds a dense T x T
mask and runs a decoder over every rollout, so a set has at most
``max_sequences * max_len`` tokens (96 by default) and usually far fewer
unique ones.
"""

from __future__ import annotations

from hypothesis import strategies as st

import dta_ref

DEFAULT_MAX_SEQUENCES = 8
DEFAULT_MAX_LEN = 12
DEFAULT_VOCAB_SIZE = 64
DEFAULT_MAX_NODES = 60


def token_ids(vocab_size: int = DEFAULT_VOCAB_SIZE) -> st.SearchStrategy[int]:
    """A token id in ``[0, vocab_size)``, with the two edge ids drawn often."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    return st.one_of(st.sampled_from(sorted({0, vocab_size - 1})), st.integers(0, vocab_size - 1))


def seeds() -> st.SearchStrategy[int]:
    """A seed for ``torch.Generator().manual_seed`` (random weights, advantages, upstream gradients)."""
    return st.integers(0, 2**31 - 1)


@st.composite
def _shuffled(draw, sequences):
    return [list(s) for s in draw(st.permutations(sequences))]


@st.composite
def random_trie_rollouts(
    draw,
    max_sequences: int = DEFAULT_MAX_SEQUENCES,
    max_len: int = DEFAULT_MAX_LEN,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    max_nodes: int = DEFAULT_MAX_NODES,
    tokens: st.SearchStrategy[int] | None = None,
):
    """Grow a random trie of at most ``max_nodes`` nodes, then return root-to-node paths.

    Each new node extends the newest node, hangs under a random earlier one or
    starts a new root (in that order of likelihood). The rollouts are the
    paths to 1..``max_sequences`` randomly chosen nodes, repeats allowed, so
    they branch at random depths and may end inside each other. ``tokens``
    overrides the token strategy (default :func:`token_ids`).
    """
    tokens = token_ids(vocab_size) if tokens is None else tokens
    num_nodes = draw(st.integers(1, max_nodes))
    paths: list[tuple[int, ...]] = []
    seen: set[tuple[int, ...]] = set()
    for _ in range(num_nodes):
        move = draw(st.integers(0, 9))  # 0: new root, 1-3: under any node, 4-9: extend the newest node
        if move == 0 or not paths:
            prefix = ()
        elif move <= 3:
            prefix = paths[draw(st.integers(0, len(paths) - 1))]
        else:
            prefix = paths[-1]
        if len(prefix) >= max_len:
            prefix = ()
        path = prefix + (draw(tokens),)
        if path not in seen:  # (parent, token) already a node: the trie is unchanged
            seen.add(path)
            paths.append(path)
    chosen = draw(st.lists(st.integers(0, len(paths) - 1), min_size=1, max_size=max_sequences))
    return draw(_shuffled([paths[i] for i in chosen]))


@st.composite
def deep_chains(
    draw,
    max_sequences: int = DEFAULT_MAX_SEQUENCES,
    max_len: int = DEFAULT_MAX_LEN,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
):
    """Prefixes of one chain of up to ``max_len`` tokens, as in multi-turn samples.

    The whole chain is always included; the others end at random depths.
    """
    chain = draw(st.lists(token_ids(vocab_size), min_size=1, max_size=max_len))
    cuts = draw(st.lists(st.integers(1, len(chain)), min_size=0, max_size=max_sequences - 1))
    return draw(_shuffled([chain] + [chain[:c] for c in cuts]))


@st.composite
def wide_fans(
    draw,
    max_sequences: int = DEFAULT_MAX_SEQUENCES,
    max_len: int = DEFAULT_MAX_LEN,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
):
    """A shared prefix (possibly empty) and up to ``max_sequences`` sibling branches.

    Branches start with distinct tokens and add at most two more; with an
    empty prefix this is a forest of single-token roots.
    """
    prefix = draw(st.lists(token_ids(vocab_size), min_size=0, max_size=max_len - 1))
    room = max_len - len(prefix)
    firsts = draw(st.lists(token_ids(vocab_size), min_size=1, max_size=max_sequences, unique=True))
    tail = st.lists(token_ids(vocab_size), max_size=min(2, room - 1))
    return draw(_shuffled([prefix + [f] + draw(tail) for f in firsts]))


@st.composite
def with_duplicates(
    draw,
    max_sequences: int = DEFAULT_MAX_SEQUENCES,
    max_len: int = DEFAULT_MAX_LEN,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
):
    """A random trie set in which at least one rollout appears more than once (needs max_sequences >= 2)."""
    if max_sequences < 2:
        raise ValueError(f"duplicates need max_sequences >= 2, got {max_sequences}")
    base = draw(random_trie_rollouts(max_sequences - 1, max_len, vocab_size, max_nodes=30))
    room = max_sequences - len(base)
    repeats = draw(st.lists(st.integers(0, len(base) - 1), min_size=1, max_size=room))
    return draw(_shuffled(base + [base[i] for i in repeats]))


@st.composite
def prefix_of_another(
    draw,
    max_sequences: int = DEFAULT_MAX_SEQUENCES,
    max_len: int = DEFAULT_MAX_LEN,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
):
    """A rollout of >= 2 tokens and a proper prefix of it, plus up to a few random others.

    The prefix's last token is a branch-free interior node of the trie that is
    also the end of a rollout (no next-token logprob for that rollout there).
    """
    if max_len < 2 or max_sequences < 2:
        raise ValueError(f"a proper prefix needs max_len >= 2 and max_sequences >= 2, got {max_len}, {max_sequences}")
    long = draw(st.lists(token_ids(vocab_size), min_size=2, max_size=max_len))
    cut = draw(st.integers(1, len(long) - 1))
    others: list[list[int]] = []
    if max_sequences > 2 and draw(st.booleans()):
        others = draw(random_trie_rollouts(max_sequences - 2, max_len, vocab_size, max_nodes=20))
    return draw(_shuffled([long, long[:cut]] + others[: max(0, max_sequences - 2)]))


@st.composite
def length_one_sequences(
    draw,
    max_sequences: int = DEFAULT_MAX_SEQUENCES,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
):
    """Every rollout is a single token (repeats allowed): no next-token logprob at all."""
    firsts = draw(st.lists(token_ids(vocab_size), min_size=1, max_size=max_sequences))
    return [[t] for t in firsts]


@st.composite
def forests(
    draw,
    max_sequences: int = DEFAULT_MAX_SEQUENCES,
    max_len: int = DEFAULT_MAX_LEN,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
):
    """Two to four trees with distinct first tokens, each a small random trie below its root."""
    max_roots = max(2, min(4, max_sequences, vocab_size))
    roots = draw(st.lists(token_ids(vocab_size), min_size=2, max_size=max_roots, unique=True))
    per_root = max(1, max_sequences // len(roots))
    sequences = []
    for r in roots:
        below = [[]]  # the bare root
        if max_len > 1 and (per_root > 1 or draw(st.booleans())):
            below = draw(random_trie_rollouts(per_root, max_len - 1, vocab_size, max_nodes=15))
            if len(below) < per_root and draw(st.booleans()):
                below.append([])
        sequences += [[r] + s for s in below]
    return draw(_shuffled(sequences))


def vocab_edge_rollouts(
    max_sequences: int = DEFAULT_MAX_SEQUENCES,
    max_len: int = DEFAULT_MAX_LEN,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
):
    """A random trie over the two token ids 0 and ``vocab_size - 1`` only (heavy sharing)."""
    edges = st.sampled_from(sorted({0, vocab_size - 1}))
    return random_trie_rollouts(max_sequences, max_len, vocab_size, max_nodes=DEFAULT_MAX_NODES, tokens=edges)


def rollout_sets(
    max_sequences: int = DEFAULT_MAX_SEQUENCES,
    max_len: int = DEFAULT_MAX_LEN,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
):
    """The default mix: any of the strategies of this module, with these bounds.

    Draws ``list[list[int]]``: 1..``max_sequences`` rollouts, each of
    1..``max_len`` tokens in ``[0, vocab_size)``.
    """
    if max_sequences < 1 or max_len < 1:
        raise ValueError(f"max_sequences and max_len must be >= 1, got {max_sequences}, {max_len}")
    kinds = [
        random_trie_rollouts(max_sequences, max_len, vocab_size),
        deep_chains(max_sequences, max_len, vocab_size),
        wide_fans(max_sequences, max_len, vocab_size),
        length_one_sequences(max_sequences, vocab_size),
        vocab_edge_rollouts(max_sequences, max_len, vocab_size),
    ]
    if max_sequences >= 2:
        kinds.append(with_duplicates(max_sequences, max_len, vocab_size))
    if max_sequences >= 2 and max_len >= 2:
        kinds.append(prefix_of_another(max_sequences, max_len, vocab_size))
    if max_sequences >= 2 and vocab_size >= 2:
        kinds.append(forests(max_sequences, max_len, vocab_size))
    return st.one_of(kinds)


def prefix_trees(
    max_sequences: int = DEFAULT_MAX_SEQUENCES,
    max_len: int = DEFAULT_MAX_LEN,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
):
    """``(sequences, dta_ref.PrefixTree.from_sequences(sequences))`` for a :func:`rollout_sets` draw."""
    return rollout_sets(max_sequences, max_len, vocab_size).map(lambda s: (s, dta_ref.PrefixTree.from_sequences(s)))
