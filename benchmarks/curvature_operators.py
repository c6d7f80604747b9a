"""Curvature operators: avionics vs curvlinops, side by side in one run.

On an MLP 784-256-256-10 (batch 128), the DeepOBS 3c3d CNN on 32x32x3 images (batch 128) and
a small GPT (2 blocks, width 128, 4 heads, context 64, vocabulary 512; batch 32), for every
operator: construction time (with the default determinism check), the time of one
matrix-vector product and of a product with 16 columns, and the peak growth of the resident
memory during the 16-column product; next to the time of one gradient. Times are the CPU time
of the computing thread (``time.thread_time``, torch on one thread), the median over repeats
of a product (and of each feature below) with avionics and curvlinops alternating:
on a shared machine wall-clock times mostly measure the neighbours.

The features beyond the operators' products (the Hessian's blocks, KFAC's scalars, damped
inverses, FOOF, KFAC-reduce and state, XTrace / XDiag / the Jacobian's Frobenius norm,
spectrum boundaries, LSMR, submatrices, curvlinops' EF and KFAC conventions) are timed side
by side on the MLP: each row is the whole call in both libraries, the same inputs and budget
of products.

Run: ``python -m benchmarks.curvature_operators`` (writes its section of BENCHMARKS.md);
``--features`` times only the features and replaces their table in the section, and
``--problems`` with some of the problems replaces only their tables; ``--operators`` with
some of the operators measures only those and keeps the other rows of the tables as they are.
"""

from __future__ import annotations

import argparse
import re
import statistics
import threading
import time
import warnings
from importlib.metadata import version

import torch
from torch import nn

from avionics.curvature import (
    ActivationHessianOperator,
    EFOperator,
    EKFACOperator,
    GGNOperator,
    HessianOperator,
    JacobianOperator,
    KFACOperator,
    MCFisherOperator,
    SubmatrixOperator,
    TransposedJacobianOperator,
)
from avionics.curvature._data import MathAttention
from avionics.curvature.algorithms import (
    approximate_boundaries,
    frobenius_norm_squared,
    lsmr,
    xdiag,
    xtrace,
)
from benchmarks.report import BENCHMARKS_MD, machine, table, write_section

COLUMNS = 16


# ------------------------------------------------------------------------------------------
# Problems
# ------------------------------------------------------------------------------------------


def mlp_problem():
    model = nn.Sequential(
        nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    X, y = torch.randn(128, 784), torch.randint(0, 10, (128,))
    return model, nn.CrossEntropyLoss(), [(X, y)], ("4", "input", 0)


def cnn_3c3d_problem():
    model = nn.Sequential(
        nn.Conv2d(3, 64, 5), nn.ReLU(), nn.MaxPool2d(3, 2, padding=1),
        nn.Conv2d(64, 96, 3), nn.ReLU(), nn.MaxPool2d(3, 2, padding=1),
        nn.Conv2d(96, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2, padding=1),
        nn.Flatten(),
        nn.Linear(128 * 3 * 3, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
        nn.Linear(256, 10),
    )  # fmt: skip
    X, y = torch.randn(128, 3, 32, 32), torch.randint(0, 10, (128,))
    return model, nn.CrossEntropyLoss(), [(X, y)], ("10", "input", 0)


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x):
        T = x.shape[1]
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), 1)
        h = self.ln1(x)
        x = x + self.attention(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token and position embeddings, pre-LN blocks, final LayerNorm, LM head.

    Returns logits [N, vocabulary, T] (class axis 1, as CrossEntropyLoss wants).
    """

    def __init__(self, vocabulary=512, width=128, heads=4, context=64, blocks=2):
        super().__init__()
        self.tokens = nn.Embedding(vocabulary, width)
        self.positions = nn.Parameter(0.02 * torch.randn(context, width))
        self.blocks = nn.Sequential(*[Block(width, heads) for _ in range(blocks)])
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocabulary)

    def forward(self, idx):
        x = self.tokens(idx) + self.positions[: idx.shape[1]]
        return self.head(self.ln_f(self.blocks(x))).transpose(1, 2)


def gpt_problem():
    X, y = torch.randint(0, 512, (32, 64)), torch.randint(0, 512, (32, 64))
    return GPT().eval(), nn.CrossEntropyLoss(), [(X, y)], ("ln_f", "output", 0)


PROBLEMS = {"MLP": mlp_problem, "3c3d": cnn_3c3d_problem, "GPT": gpt_problem}


# ------------------------------------------------------------------------------------------
# Operators: (ours, reference) factories
# ------------------------------------------------------------------------------------------


def operator_pairs(model, loss_fn, data, activation):
    import curvlinops
    from curvlinops.experimental.activation_hessian import ActivationHessianLinearOperator

    params = [p for p in model.parameters() if p.requires_grad]
    kfac_names = [
        f"{name}.{kind}"
        for name, module in model.named_modules()
        if isinstance(module, (nn.Linear, nn.Conv2d)) and not name.endswith("out_proj")
        for kind, _ in module.named_parameters(recurse=False)
    ]
    kfac_params = [dict(model.named_parameters())[name] for name in kfac_names]
    return {
        "Hessian": (
            lambda: HessianOperator(model, loss_fn, None, data),
            lambda: curvlinops.HessianLinearOperator(model, loss_fn, params, data),
        ),
        "GGN": (
            lambda: GGNOperator(model, loss_fn, None, data),
            lambda: curvlinops.GGNLinearOperator(model, loss_fn, params, data),
        ),
        "EF": (
            lambda: EFOperator(model, loss_fn, None, data),
            lambda: curvlinops.EFLinearOperator(model, loss_fn, params, data),
        ),
        "MC Fisher": (
            lambda: MCFisherOperator(model, loss_fn, None, data),
            lambda: curvlinops.FisherMCLinearOperator(model, loss_fn, params, data),
        ),
        "Jacobian": (
            lambda: JacobianOperator(model, None, data),
            lambda: curvlinops.JacobianLinearOperator(model, params, data),
        ),
        "transposed Jacobian": (
            lambda: TransposedJacobianOperator(model, None, data),
            lambda: curvlinops.TransposedJacobianLinearOperator(model, params, data),
        ),
        "activation Hessian": (
            lambda: ActivationHessianOperator(model, loss_fn, activation, data),
            lambda: ActivationHessianLinearOperator(model, loss_fn, activation, data),
        ),
        "KFAC": (
            lambda: KFACOperator(model, loss_fn, kfac_names, data),
            lambda: curvlinops.KFACLinearOperator(model, loss_fn, kfac_params, data),
        ),
        "EKFAC": (
            lambda: EKFACOperator(model, loss_fn, kfac_names, data),
            lambda: curvlinops.EKFACLinearOperator(model, loss_fn, kfac_params, data),
        ),
    }


# ------------------------------------------------------------------------------------------
# Measurement
# ------------------------------------------------------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def timed_with_peak_memory(fn) -> tuple[float, float]:
    """CPU time (ms) of ``fn`` and the peak growth of the resident set size while it runs
    (MiB, sampled every ms by another thread, whose time is not counted)."""
    baseline, peak, running = _rss_bytes(), [0], [True]

    def sample():
        while running[0]:
            peak[0] = max(peak[0], _rss_bytes())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        start = time.thread_time()
        fn()
        milliseconds = 1e3 * (time.thread_time() - start)
    finally:
        running[0] = False
        sampler.join()
    return milliseconds, max(peak[0], _rss_bytes()) / 2**20 - baseline / 2**20


def alternating_times(fns: list, repeats: int) -> list[list[float]]:
    """CPU times (ms) of each function, calling them in turn ``repeats`` times."""
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, fn_times in zip(fns, times):
            start = time.thread_time()
            fn()
            fn_times.append(1e3 * (time.thread_time() - start))
    return times


def alternating_min_times(fns: list, repeats: int) -> list[float]:
    """Minimum CPU time (ms) of each function, calling them in turn ``repeats`` times."""
    return [min(fn_times) for fn_times in alternating_times(fns, repeats)]


def alternating_median_times(fns: list, repeats: int) -> list[float]:
    """Median CPU time (ms) of each function, calling them in turn ``repeats`` times (for an
    even count, the mean of the middle two)."""
    return [statistics.median(fn_times) for fn_times in alternating_times(fns, repeats)]


def gradient_time(model, loss_fn, data, repeats: int) -> float:
    params = [p for p in model.parameters() if p.requires_grad]

    def gradient():
        for X, y in data:
            torch.autograd.grad(loss_fn(model(X), y), params)

    gradient()  # warm-up
    return alternating_min_times([gradient], repeats)[0]


def construct(factory, warm_up: bool):
    """Construct (twice when ``warm_up``: the first call pays one-time costs), time the last."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if warm_up:
            factory()
        start = time.thread_time()
        operator = factory()
    return operator, 1e3 * (time.thread_time() - start)


def measure(factories, repeats: int) -> dict:
    """Both operators of one kind: construction, 1- and 16-column products, memory.

    Each side is constructed twice and the second timed, so that neither pays the one-time
    costs of code paths (torch.func transforms) the other warmed up. The first 16-column
    product of each operator measures its memory only: its time (cold, where the 1-column
    warm-up took another code path) is not counted.
    """
    operators, results = [], {}
    for side, factory in zip(("ours", "ref"), factories):
        try:
            operator, milliseconds = construct(factory, warm_up=True)
        except Exception as error:  # the reference does not support every problem
            results[side] = f"n/a ({type(error).__name__})"
            continue
        operators.append((side, operator))
        results[side] = {"construct": milliseconds}
    if not operators:
        return results
    generator = torch.Generator().manual_seed(0)
    D = operators[0][1].shape[1]
    v, V = torch.randn(D, generator=generator), torch.randn(D, COLUMNS, generator=generator)
    for side, A in operators:
        A @ v  # warm-up
        _, results[side]["memory"] = timed_with_peak_memory(lambda A=A: A @ V)
    vector_times = alternating_median_times([lambda A=A: A @ v for _, A in operators], repeats)
    matrix_times = alternating_median_times(
        [lambda A=A: A @ V for _, A in operators], max(repeats - 1, 1)
    )
    for (side, _), t1, tk in zip(operators, vector_times, matrix_times):
        results[side].update({"vector": t1, "matrix": tk})
    return results


# ------------------------------------------------------------------------------------------
# Features beyond the products, side by side
# ------------------------------------------------------------------------------------------

FEATURES_HEADING = "### Features beyond the products (MLP)"


def feature_pairs(model, loss_fn, data) -> dict:
    """(ours, curvlinops) zero-argument calls, each doing one whole feature."""
    import curvlinops
    from curvlinops.papyan2020traces.spectrum import approximate_boundaries as their_boundaries

    params = [p for p in model.parameters() if p.requires_grad]
    generator = torch.Generator().manual_seed(0)
    V = torch.randn(sum(p.numel() for p in params), COLUMNS, generator=generator)
    B4 = V[:, :4].contiguous()
    quiet = {"check_deterministic": False}
    blocks = [1] * len(params)
    H_ours = HessianOperator(model, loss_fn, None, data, block_sizes=blocks, **quiet)
    H_theirs = curvlinops.HessianLinearOperator(model, loss_fn, params, data, block_sizes=blocks,
                                                **quiet)  # fmt: skip
    G_ours = GGNOperator(model, loss_fn, None, data, **quiet)
    G_theirs = curvlinops.GGNLinearOperator(model, loss_fn, params, data, **quiet)
    J_ours = JacobianOperator(model, None, data, **quiet)
    # curvlinops' norm transposes a wide operator with .T, which its Jacobian lacks: give it
    # the transposed (tall) Jacobian, as ours uses internally (||J||_F = ||J^T||_F)
    JT_theirs = curvlinops.TransposedJacobianLinearOperator(model, params, data, **quiet)
    K_ours = KFACOperator(model, loss_fn, None, data, **quiet)
    K_theirs = curvlinops.KFACLinearOperator(model, loss_fn, params, data, **quiet)
    K_theirs.compute_kronecker_factors()
    state_ours, state_theirs = K_ours.state_dict(), K_theirs.state_dict()
    rows = torch.randperm(V.shape[0], generator=generator)[:1000].tolist()
    columns = torch.randperm(V.shape[0], generator=generator)[:1000].tolist()
    X_sub = torch.randn(1000, COLUMNS, generator=generator)

    def our_scalars():
        return K_ours.trace(), K_ours.logdet(), K_ours.frobenius_norm()

    def their_scalars():
        K_theirs._reset_matrix_properties()
        return K_theirs.trace, K_theirs.logdet, K_theirs.frobenius_norm

    def our_inverse():
        return K_ours.inverse(1e-3, mode="heuristic") @ V

    def their_inverse():
        inverse = curvlinops.KFACInverseLinearOperator(K_theirs, 1e-3, use_heuristic_damping=True)
        return inverse @ V

    inverse_ours = K_ours.inverse(1e-3, mode="heuristic")
    inverse_theirs = curvlinops.KFACInverseLinearOperator(
        K_theirs, 1e-3, use_heuristic_damping=True
    )
    inverse_theirs @ V  # curvlinops inverts its factors on the first product

    return {
        f"Hessian, one block per parameter, {COLUMNS} columns": (
            lambda: H_ours @ V,
            lambda: H_theirs @ V,
        ),
        "KFAC trace + logdet + Frobenius norm (from the factors)": (our_scalars, their_scalars),
        f"KFAC inverse, heuristic damping: the damped factors inverted + {COLUMNS} columns": (
            our_inverse,
            their_inverse,
        ),
        f"KFAC inverse, heuristic damping: {COLUMNS} columns": (
            lambda: inverse_ours @ V,
            lambda: inverse_theirs @ V,
        ),
        "KFAC construction (no determinism check)": (
            lambda: KFACOperator(model, loss_fn, None, data, **quiet),
            lambda: curvlinops.KFACLinearOperator(
                model, loss_fn, params, data, **quiet
            ).compute_kronecker_factors(),
        ),
        "EKFAC construction (no determinism check; curvlinops' factors, eigenbases and "
        "corrections)": (
            lambda: EKFACOperator(model, loss_fn, None, data, **quiet),
            lambda: curvlinops.EKFACLinearOperator(
                model, loss_fn, params, data, **quiet
            )._maybe_compute_ekfac(),
        ),
        "KFAC-reduce construction": (
            lambda: KFACOperator(model, loss_fn, None, data, kfac_approx="reduce", **quiet),
            lambda: curvlinops.KFACLinearOperator(
                model, loss_fn, params, data, kfac_approx="reduce", **quiet
            ).compute_kronecker_factors(),
        ),
        "FOOF (forward-only) construction": (
            lambda: KFACOperator(model, loss_fn, None, data, fisher_type="forward-only", **quiet),
            lambda: curvlinops.KFACLinearOperator(
                model, loss_fn, params, data, fisher_type="forward-only", **quiet
            ).compute_kronecker_factors(),
        ),
        "KFAC from its state dict": (
            lambda: KFACOperator.from_state_dict(state_ours, model, loss_fn, None, data),
            lambda: curvlinops.KFACLinearOperator.from_state_dict(
                state_theirs, model, params, data, check_deterministic=False
            ),
        ),
        f"XTrace, Rademacher, {COLUMNS} products (GGN)": (
            lambda: xtrace(G_ours, COLUMNS, distribution="rademacher"),
            lambda: curvlinops.xtrace(G_theirs, COLUMNS, distribution="rademacher"),
        ),
        f"XDiag, {COLUMNS} products (GGN)": (
            lambda: xdiag(G_ours, COLUMNS),
            lambda: curvlinops.xdiag(G_theirs, COLUMNS),
        ),
        f"Jacobian's squared Frobenius norm, {COLUMNS} products": (
            lambda: frobenius_norm_squared(J_ours, COLUMNS),
            lambda: curvlinops.hutchinson_squared_fro(JT_theirs, COLUMNS),
        ),
        "spectrum boundaries (GGN; ours 20 Lanczos steps, curvlinops eigsh tol 1e-2)": (
            lambda: approximate_boundaries(G_ours, 20),
            lambda: their_boundaries(G_theirs, tol=1e-2),
        ),
        "LSMR, 4 right-hand sides, 10 iterations, damping 1 (GGN)": (
            lambda: lsmr(G_ours, B4, damping=1.0, maxiter=10),
            lambda: curvlinops.LSMRInverseLinearOperator(G_theirs, damp=1.0, maxiter=10) @ B4,
        ),
        f"submatrix 1000 x 1000 of the GGN, {COLUMNS} columns": (
            lambda: SubmatrixOperator(G_ours, rows, columns) @ X_sub,
            lambda: curvlinops.SubmatrixLinearOperator(G_theirs, rows, columns) @ X_sub,
        ),
        "KFAC type-2, convention='curvlinops', construction": (
            lambda: KFACOperator(
                model, loss_fn, None, data, fisher_type="type-2", convention="curvlinops", **quiet
            ),
            lambda: curvlinops.KFACLinearOperator(
                model, loss_fn, params, data, fisher_type="type-2", **quiet
            ).compute_kronecker_factors(),
        ),  # fmt: skip
        f"EF, convention='curvlinops', {COLUMNS} columns": (
            lambda: EFOperator(model, loss_fn, None, data, convention="curvlinops", **quiet) @ V,
            lambda: curvlinops.EFLinearOperator(model, loss_fn, params, data, **quiet) @ V,
        ),
    }


def run_features(repeats: int) -> str:
    """The features table on the MLP (both libraries warmed up once, then alternated)."""
    torch.manual_seed(0)
    model, loss_fn, data, _ = mlp_problem()
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, (ours, theirs) in feature_pairs(model, loss_fn, data).items():
            print(f"features: {name}", flush=True)
            ours(), theirs()  # warm-up
            ours_ms, theirs_ms = alternating_median_times([ours, theirs], repeats)
            rows.append([name, _format(ours_ms), _format(theirs_ms),
                         _format(theirs_ms / ours_ms, 2)])  # fmt: skip
    header = ["feature", "ours (ms)", "curvlinops (ms)", "ratio"]
    return (
        f"{FEATURES_HEADING}\n\n{machine()}; curvlinops {version('curvlinops-for-pytorch')}. "
        f"CPU time of one thread, median over {repeats} alternating repeats after a warm-up; "
        "ratio = curvlinops / avionics (> 1: avionics is faster). The KFAC rows use the MC "
        "Fisher (curvlinops' default); the scalars of curvlinops are its cached properties, "
        "reset before each call.\n\n" + table(header, rows)
    )


def with_features(section: str, features: str) -> str:
    """``section`` with its features table replaced by (or appended as) ``features``."""
    return with_table(section, FEATURES_HEADING, features)


def with_table(section: str, heading: str, text: str) -> str:
    """``section`` with the part under ``heading`` (up to the next ### heading) replaced by
    ``text``, or ``text`` appended where there is none."""
    pattern = re.compile(re.escape(heading) + r"\n.*?(?=\n+### |\s*\Z)", re.S)
    if pattern.search(section):
        return pattern.sub(lambda _: text.rstrip(), section)
    return section.rstrip() + "\n\n" + text


def with_problems(section: str, measured: str, problems: list[str]) -> str:
    """``section`` with the tables of ``problems`` and the heading paragraph (the method)
    replaced by those of ``measured`` (the output of :func:`run` for them); the other tables
    and the features stay."""
    heading = re.compile(r"\A.*?(?=\n+### )", re.S)
    if heading.search(section):
        section = heading.sub(lambda _: heading.search(measured).group(0), section, count=1)
    for name in problems:
        heading = f"### {name}"
        match = re.search(re.escape(heading) + r"\n.*?(?=\n+### |\s*\Z)", measured, re.S)
        section = with_table(section, heading, match.group(0))
    return section


def current_section() -> str:
    text = BENCHMARKS_MD.read_text() if BENCHMARKS_MD.exists() else ""
    match = re.search(r"<!-- curvature-operators:start -->\n(.*?)\n<!-- curvature-operators:end",
                      text, re.S)  # fmt: skip
    return match.group(1) if match else ""


def _format(value, digits=1) -> str:
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def kept_rows(section: str, problem: str) -> dict[str, list[str]]:
    """The rows (operator -> cells) of ``problem``'s table in ``section``, to keep unmeasured."""
    match = re.search(rf"### {re.escape(problem)}\n.*?(?=\n+### |\s*\Z)", section, re.S)
    lines = match.group(0).splitlines() if match else []
    rows = [[c.strip() for c in line.strip()[1:-1].split("|")] for line in lines
            if line.startswith("| ")]  # fmt: skip
    return {row[0]: row[1:] for row in rows[1:]}  # rows[0] is the header


def run(problems: list[str], repeats: dict[str, int], operators: list[str] | None = None) -> str:
    """The tables of ``problems``; of ``operators`` only (None: all), the other rows as they
    are in the current section (an operator without a row there is left out)."""
    torch.manual_seed(0)
    sections = [
        f"## Curvature operators vs curvlinops\n\n{machine()}; curvlinops "
        f"{version('curvlinops-for-pytorch')}. CPU times in ms of one thread, on a shared "
        f"machine under load: products the median over alternating repeats ({repeats}; 16 "
        f"columns one fewer), after a warm-up of each (a 1-column and a {COLUMNS}-column "
        "product); construction once, after a first construction of each; memory = peak RSS "
        f"growth during the first {COLUMNS}-column product (MiB). ratio = curvlinops time / "
        "avionics time (> 1: avionics is faster)."
        + (
            f" Measured in this run: {', '.join(operators)}; the other rows are kept from the "
            "previous run."
            if operators is not None
            else ""
        )
    ]
    for name in problems:
        model, loss_fn, data, activation = PROBLEMS[name]()
        gradient_ms = gradient_time(model, loss_fn, data, repeats[name])
        rows, kept = [], kept_rows(current_section(), name)
        for kind, factories in operator_pairs(model, loss_fn, data, activation).items():
            if operators is not None and kind not in operators:
                if kind in kept:
                    rows.append([kind, *kept[kind]])
                continue
            print(f"{name}: {kind}", flush=True)
            # curvlinops cannot differentiate through the fused attention kernels (forward
            # mode, double backward); select the math kernel for it as avionics does itself.
            with MathAttention():
                results = measure(factories, repeats[name])
            ours, ref = results["ours"], results["ref"]
            if not isinstance(ours, dict):
                rows.append([kind, ours] + [""] * 11)
                continue
            row = [kind]
            for key in ("construct", "vector", "matrix"):
                row.append(_format(ours[key]))
                row.append(_format(ref[key]) if isinstance(ref, dict) else ref)
                row.append(_format(ref[key] / ours[key], 2) if isinstance(ref, dict) else "")
            row.append(_format(ours["vector"] / gradient_ms, 2))
            row.append(_format(ours["memory"], 0))
            row.append(_format(ref["memory"], 0) if isinstance(ref, dict) else "")
            rows.append(row)
        header = ["operator"]
        for key in ("construct", "1 column", f"{COLUMNS} columns"):
            header += [f"{key} (ours)", f"{key} (curvlinops)", "ratio"]
        header += ["1 column / gradient", "MiB (ours)", "MiB (curvlinops)"]
        note = (
            "\n\ncurvlinops as installed fails on this model (NotImplementedError: no forward-mode"
            " derivative / double backward for the fused attention kernels); the benchmark "
            "runs both libraries with the math attention kernel, which avionics selects itself."
            if name == "GPT"
            else ""
        )
        sections.append(
            f"### {name}\n\nOne gradient: {gradient_ms:.1f} ms.{note}\n\n{table(header, rows)}"
        )
    return "\n\n".join(sections)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", nargs="+", default=list(PROBLEMS), choices=list(PROBLEMS))
    parser.add_argument("--repeats", type=int, nargs=3, default=[10, 1, 2],
                        help="timed repeats on MLP, 3c3d, GPT")  # fmt: skip
    parser.add_argument("--operators", nargs="+", default=None,
                        help="measure only these operators (keep the other rows)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument(
        "--features",
        action="store_true",
        help="time only the features beyond the products (on the MLP)",
    )
    parser.add_argument("--feature-repeats", type=int, default=9)  # fmt: skip
    parser.add_argument("--no-write", action="store_true", help="print, don't write the file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    repeats = dict(zip(PROBLEMS, args.repeats))
    if args.features:
        markdown = with_features(current_section(), run_features(args.feature_repeats))
    elif set(args.problems) != set(PROBLEMS) or args.operators:  # their tables only
        measured = run(args.problems, repeats, args.operators)
        markdown = with_problems(current_section(), measured, args.problems)
    else:
        markdown = with_features(run(args.problems, repeats), run_features(args.feature_repeats))
    print(markdown)
    if not args.no_write:
        write_section("curvature-operators", markdown)


if __name__ == "__main__":
    main()
