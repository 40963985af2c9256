"""Choosing the chunking: the largest chunk size whose estimate fits a memory budget, the cheapest plan
over keep or recompute, the head's logits window and checkpointed layers, and the automatic budget on
CUDA (docs/chunked_execution.md, "Choosing the chunk size")."""

from __future__ import annotations

import torch

from dta_ref.checks import check_bytes, check_flag, check_tree
from dta_ref.tree import PrefixTree

from .memory import MemoryModel, check_checkpoint_layers, format_bytes, unset_grad_bytes
from .options import TreeBackwardOptions
from .plan import ChunkPlan, Forest, plan_chunks, with_prefix_pieces

# Below this many tokens a budget that the first sizes tried miss is checked against every size.
EXHAUSTIVE_SEARCH_TOKENS = 1024


def largest_fitting_plan(
    memory: MemoryModel,
    forest: Forest,
    budget: int,
    *,
    recompute: bool,
    tolerance: float = 0.0,
    logits_rows: int | None = None,
    checkpoint_layers: bool = False,
    smallest: int = 1,
) -> ChunkPlan:
    """The plan (without prefix pieces) of the largest chunk size whose estimate fits ``budget``, or of
    one within ``tolerance`` (relative) of it where the next size up does not fit; ValueError when none
    fits. Its head runs windows of ``logits_rows`` rows (None: the default), its layers under activation
    checkpointing with ``checkpoint_layers``. Sizes under ``smallest`` are not tried.

    Every plan holds a deepest token's whole path open at some moment, which
    bounds the estimate from below and, with one chunk's worth of tokens on
    top, gives a first guess. From there the sizes double or halve until they
    bracket the budget. Then each step guesses where the estimate meets the
    budget: along its own slope where two fitting sizes have the same chunks
    (there it grows linearly with the chunks the size bounds), along the
    bracket's chord, or, once that stalls on a step of the estimate (a chunk
    end flipping), by bisection after trying the size just above the largest
    fit: a handful of plans, more where the estimate is flat up to a
    step (docs/design_notes.md, "The budget search"). The estimate grows with the size but
    for small steps down (fewer chunks save fewer prefix copies), so "largest"
    is local: the next size up does not fit.
    """
    T = forest.num_tokens
    memo: dict[int, int] = {}  # size -> estimate
    plans: dict[int, ChunkPlan] = {}

    def fits(size):
        if size not in memo:
            plans[size] = plan_chunks(
                forest, size, recompute, with_prefix=False, logits_rows=logits_rows, checkpoint_layers=checkpoint_layers
            )
            memo[size] = memory.step_bytes(plans[size])
        return memo[size] <= budget

    path = int(forest.depth.max()) + 1 if T else 0  # some moment holds a deepest token and its ancestors
    # a first guess: the path open with its K/V (stored and copied) and accumulators, then chunk tokens
    head, floor_bytes = memory.head(logits_rows), memory.floor_bytes(path, recompute, logits_rows, checkpoint_layers)
    activation = memory.checkpointed if checkpoint_layers else memory.activation
    open_path = head + (2 * memory.kv + memory.kv_grad) * path + (0 if recompute else activation * path)
    floor = max(1, T >> 14, smallest)  # smaller chunks are never worth their planning time on a large forest
    lo = hi = None  # fits(lo); hi does not fit
    if floor_bytes <= budget:  # else nothing fits: no plan needed to say so
        per_token = activation + 2 * memory.kv + memory.kv_grad
        # not below 1024 tokens: plans of small chunks cost the most, and halving finds them
        first = size = min(T, max(floor, 1024, (budget - open_path) // per_token))
        if fits(size):
            lo = size
        else:
            hi = size
            while lo is None and size > floor:
                above, size = size, max(floor, size // 2)
                if fits(size):
                    lo = size
                else:
                    hi = size
                    if memo[size] > memo[above] and plans[size].num_chunks > 256:
                        # many chunks and halving raised the estimate (the open chunks' K/V and prefix
                        # copies outgrow the chunk's own activations): ever smaller chunks cost more to
                        # plan than they are likely to fit (down to a token a chunk, keep mode took
                        # half a second on 10K tokens)
                        break
            # not found below: the estimate is not monotone in the size (fewer chunks, fewer saved
            # prefix copies), so other sizes may still fit: all of them on a small forest, else a
            # ladder of ratio 2^(1/4) above the first guess (not for a search bounded below: the plan
            # it could find is one that a cheaper one already beats but for such flukes)
            if lo is None and smallest == 1:
                ladder = (
                    range(floor, T + 1)
                    if T <= EXHAUSTIVE_SEARCH_TOKENS
                    else sorted({min(T, int(first * 2 ** (k / 4))) for k in range(1, 4 * T.bit_length() + 1)} - {first})
                )
                lo = next((size for size in ladder if fits(size)), None)
        if lo is not None and hi is not None and hi <= lo:
            hi = None  # found above every size known not to fit (the ladder): bracket again from there
        while lo is not None and lo < T and hi is None:
            if fits(min(2 * lo, T)):
                lo = min(2 * lo, T)
            else:
                hi = min(2 * lo, T)
    if lo is None:
        if memo:
            smallest = (
                f"the smallest estimate among the {len(memo)} chunk sizes tried is {format_bytes(min(memo.values()))}"
            )
        else:
            smallest = f"every chunk size's estimate is at least {format_bytes(floor_bytes)}"
        raise ValueError(
            f"memory budget of {format_bytes(budget)} is too small: {smallest} (the open chunks' K/V, the "
            "vocabulary head's backward and "
            f"{format_bytes(activation)} of activations per chunk token"
            + ("" if recompute else "; try recompute=True")
            + ")"
        )
    fitted = [lo]  # sizes that fit, in the order found (increasing)
    interpolate, lo_moved = True, True
    while hi is not None and hi - lo > max(1, int(tolerance * lo)):  # fits(lo) and not fits(hi)
        below = fitted[-2] if len(fitted) > 1 else None
        if (
            lo_moved
            and below is not None
            and plans[below].num_chunks == plans[lo].num_chunks
            and memo[lo] > memo[below]
        ):
            # two fitting sizes with the same chunk count: the estimate's own slope here, where it
            # grows with the chunks that the size bounds
            slope = (memo[lo] - memo[below]) / (lo - below)
        elif interpolate:
            slope = (memo[hi] - memo[lo]) / (hi - lo)
        else:
            slope = None
        guess = (lo + hi) // 2 if slope is None else lo + int((budget - memo[lo]) // slope)
        guess = min(hi - 1, max(lo + 1, guess))
        width = hi - lo
        lo_moved = fits(guess)
        if lo_moved:
            lo = guess
            fitted.append(lo)
        else:
            hi = guess
        if interpolate and 2 * (hi - lo) > width:
            # the estimate is a step function here (chunk ends set by the tree, not the size): bisect,
            # after trying whether the step is right after lo, as it often is where a chunk's end flips
            interpolate = False
            if hi - lo > max(1, int(tolerance * lo)):
                lo_moved = fits(lo + 1)
                if lo_moved:
                    lo = lo + 1
                    fitted.append(lo)
                else:
                    hi = lo + 1
    return plans[lo]


def chunk_tokens_for_budget(
    model, tree: PrefixTree, memory_budget_bytes: int, recompute: bool = True, checkpoint_layers: bool | None = None
) -> int:
    """Largest chunk size whose :func:`estimated_step_bytes` fits the budget (a ValueError if none does);
    ``recompute`` and ``checkpoint_layers`` as there (None: the layers as the model runs them).

    The estimate grows with the size but for small steps down, so "largest" is local: the size returned
    fits and the next size up does not (docs/chunked_execution.md, "Choosing the
    chunk size")."""
    check_tree(tree)
    recompute = check_flag("recompute", recompute)
    budget = check_bytes("memory_budget_bytes", memory_budget_bytes)
    memory = MemoryModel.of(model)
    checkpoint_layers = bool(check_checkpoint_layers(checkpoint_layers, memory))
    forest = Forest.of(tree)
    return largest_fitting_plan(memory, forest, budget, recompute=recompute, checkpoint_layers=checkpoint_layers).size


# A chunk's fixed overhead (launches, prefix gathers, logits windows, Python) in tokens of forward work,
# weighed against recomputed tokens (docs/design_notes.md, "The cost model's constants").
CHUNK_OVERHEAD_TOKENS = 8192
# A window of the vocabulary head costs a dozen launches each way: a fraction of a millisecond.
WINDOW_OVERHEAD_TOKENS = 64
# The head's windows the automatic choice tries: the default, then halved, at most this many times, on
# plans of at most this many chunks, where one chunk less saves the most and planning is quick.
WINDOW_HALVINGS = 3
WINDOW_TRADE_MAX_CHUNKS = 256


def step_cost(memory: MemoryModel, plan: ChunkPlan) -> float:
    """Relative step time in token forwards: a cost per token and per chunk (:func:`cost_rates`),
    recomputed forwards, and the overheads of the head's windows (a chunk's rows are at most its tokens;
    a recomputed chunk runs its windows twice)."""
    windows = -(-plan.lengths // (plan.logits_rows or memory.logits_rows))
    num_windows = int(windows.sum() + windows[~plan.keeps_graph].sum())
    per_token, per_chunk = cost_rates(plan.checkpoint_layers)
    return (
        per_token * int(plan.lengths.sum())
        + plan.recomputed_tokens
        + per_chunk * plan.num_chunks
        + WINDOW_OVERHEAD_TOKENS * num_windows
    )


def cost_rates(checkpoint_layers: bool) -> tuple[int, int]:
    """Token forwards a plan costs per token (forward and backward: 3) and per chunk. Checkpointed layers
    run every chunk's forward once more in its backward: one more per token, and a third more per
    chunk (a forward of every layer on the host)."""
    if checkpoint_layers:
        return 4, CHUNK_OVERHEAD_TOKENS * 4 // 3
    return 3, CHUNK_OVERHEAD_TOKENS


def plan_for_budget(
    memory: MemoryModel,
    forest: Forest,
    budget: int,
    *,
    recompute: bool | None = None,
    strict: bool = True,
    checkpoint_layers: bool | None = None,
) -> ChunkPlan:
    """The cheapest plan (:func:`step_cost`) whose estimate fits ``budget``, over keep and recompute, over
    the head's logits window and, unless ``checkpoint_layers`` says, with or without checkpointed layers.

    The window starts at the default and halves while that makes the plan
    cheaper: where the budget is tight, the memory a smaller window frees
    lets larger chunks fit, and fewer chunks save more than the extra
    windows cost (docs/chunked_execution.md, "Memory budget"). Checkpointed
    layers keep a fraction of the activations, so where the budget cuts the
    forest into many chunks, few larger ones may cost less, their forwards
    run twice included. With ``strict`` a budget nothing fits is a
    ValueError; without (the automatic CUDA budget), the plan with the
    smallest estimate is tried.
    """
    modes = (False, True) if recompute is None else (bool(recompute),)
    T = forest.num_tokens
    found, errors = [], []
    # checkpointed layers first: their few large chunks bound how small a chunk the search without them
    # need try, as a plan of chunks of s tokens has at least T / s of them (planning many small chunks is
    # what costs time)
    for checkpoint in (True, False) if checkpoint_layers is None else (checkpoint_layers,):
        smallest = 1
        if found:
            per_token, per_chunk = cost_rates(checkpoint)
            room = step_cost(memory, found[0]) - per_token * T  # what its chunks may cost, at most
            if room <= per_chunk:
                continue
            smallest = T * per_chunk // room + 1
        plan = _cheapest_over_windows(memory, forest, budget, modes, checkpoint, errors, smallest)
        if plan is not None:
            found.append(plan)
    if found:  # a tie goes to the plan without checkpointed layers
        return with_prefix_pieces(
            forest, min(found, key=lambda plan: (step_cost(memory, plan), plan.checkpoint_layers))
        )
    if strict:
        raise errors[-1]  # the last search's smallest window: the estimate closest to the budget
    sizes = {T} | {2**i for i in range(8, T.bit_length())}
    checkpoint = checkpoint_layers is not False
    rows = max(1, memory.logits_rows >> WINDOW_HALVINGS)
    plans = (
        plan_chunks(forest, size, True, with_prefix=False, logits_rows=rows, checkpoint_layers=checkpoint)
        for size in sorted(sizes)
    )
    return with_prefix_pieces(forest, min(plans, key=memory.step_bytes))


def _cheapest_over_windows(memory, forest, budget, modes, checkpoint_layers, errors, smallest=1) -> ChunkPlan | None:
    """The cheapest fitting plan of chunks of at least ``smallest`` tokens over ``modes`` and the head's
    windows (the default, then halved while that makes the plan cheaper); None where none fits, the
    reasons added to ``errors``."""
    best = None

    def cost(plan):
        return step_cost(memory, plan)

    for halvings in range(WINDOW_HALVINGS + 1):
        rows = max(1, memory.logits_rows >> halvings)
        plans = []
        for mode in modes:
            try:
                # a size within 3% of the largest runs as fast: spare the last bisection steps
                plans.append(
                    largest_fitting_plan(
                        memory,
                        forest,
                        budget,
                        recompute=mode,
                        tolerance=1 / 32,
                        logits_rows=rows,
                        checkpoint_layers=checkpoint_layers,
                        smallest=smallest,
                    )
                )
            except ValueError as error:
                errors.append(error)
        cheapest = min(plans, key=cost, default=None)
        if cheapest is not None and (best is None or cost(cheapest) < cost(best)):
            best = cheapest
        elif best is not None and (cheapest is None or cost(cheapest) > cost(best)):
            break  # smaller windows would only add more of them (a tie goes on: it may free room later)
        if rows == 1 or (best is not None and not 1 < best.num_chunks <= WINDOW_TRADE_MAX_CHUNKS):
            break
    return best


# Share of the free device memory the automatic budget gives the estimate: headroom for the caching
# allocator's fragmentation and for models unlike those the estimate was calibrated on
# (docs/design_notes.md, "The memory estimate's calibration").
AUTO_BUDGET_FRACTION = 0.8


def free_device_bytes(model, device: torch.device) -> int:
    """Memory a step may still allocate: free on the device and in the caching allocator, less the
    parameter gradients the backward will create."""
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free + cached - unset_grad_bytes(model)


def choose_plan(model, tree: PrefixTree, device: torch.device, options: TreeBackwardOptions, head=None) -> ChunkPlan:
    """The plan of this step: a given chunk size, a given budget, or on CUDA the free memory. ``head``: the
    output head the chunks run (None: the vocabulary head)."""
    forest = Forest.of(tree)
    T = forest.num_tokens
    memory = MemoryModel.of(model, head)
    checkpoint_layers = check_checkpoint_layers(options.checkpoint_layers, memory)
    size, budget, recompute = options.max_chunk_tokens, options.memory_budget_bytes, options.recompute
    if size is not None or (budget is None and device.type != "cuda"):
        # a given size, or on CPU one chunk (one packed forward and backward); layers as the model runs them
        size, checkpoint = min(size or T, T), bool(checkpoint_layers)
        if recompute is None and options.max_chunk_tokens is not None:  # on when chunked
            plan = plan_chunks(forest, size, False, checkpoint_layers=checkpoint)
            return plan if plan.num_chunks == 1 else plan_chunks(forest, size, True, checkpoint_layers=checkpoint)
        return plan_chunks(forest, size, bool(recompute), checkpoint_layers=checkpoint)
    if budget is not None:
        return plan_for_budget(memory, forest, budget, recompute=recompute, checkpoint_layers=checkpoint_layers)
    total = torch.cuda.get_device_properties(device).total_memory
    margin = total // 20 if options.memory_margin_bytes is None else options.memory_margin_bytes
    budget = int(AUTO_BUDGET_FRACTION * (free_device_bytes(model, device) - margin))
    return plan_for_budget(
        memory, forest, max(budget, 1), recompute=recompute, strict=False, checkpoint_layers=checkpoint_layers
    )
