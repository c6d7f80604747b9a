"""The three screens of runs on real models (tests/real_models.py): Hugging Face GPT-2 with
the "transformer" preset (AdamW) and the BERT classifier with "business", whose parameter
names run to 50 characters. Every panel drawn has data (lines, points, bars or a colour
mesh), or says why it has none; every text (titles, axis and tick labels, legends) lies
inside the figure; no tick label reaches into another panel; names are at most
LABEL_WIDTH characters."""

from __future__ import annotations

import warnings

import matplotlib
import pytest
import real_models
from acceptance import optimizer_for
from matplotlib.backends.backend_agg import FigureCanvasAgg

from avionics import Cockpit, configuration
from avionics.dashboard import plot, plot_health, plot_secondary
from avionics.dashboard.figure import COLUMNS
from avionics.dashboard.style import LABEL_WIDTH, short_labels

matplotlib.use("Agg")

RUNS = {
    "gpt2-transformer": (lambda: real_models.gpt2_lm(n=4, t=6, width=16), "transformer"),
    "bert-business": (lambda: real_models.bert_classifier(n=4, t=6, width=16), "business"),
}
GROUPS = {group for group, _ in COLUMNS} | {"PER LAYER", "AUXILIARY", "LAYER HEALTH"}


@pytest.fixture(scope="module", params=sorted(RUNS))
def logged(request, tmp_path_factory):
    """Three tracked steps of the README's loop, logged: the run's folder."""
    build, preset = RUNS[request.param]
    model, X, y, loss_fn = build()
    model = model.float()
    optimizer = optimizer_for(preset, model.parameters())
    log = tmp_path_factory.mktemp(request.param)
    cockpit = Cockpit(model, quantities=configuration(preset), log=str(log))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(3):
            losses = loss_fn(model(X), y)
            info = {"loss": losses.mean(), "individual_losses": losses, "batch_size": len(y)}
            with cockpit(step, {**info, "optimizer": optimizer}):
                losses.mean().backward(create_graph=cockpit.create_graph(step))
            optimizer.step()
            optimizer.zero_grad()
    cockpit.close()
    return log


def has_data(ax) -> bool:
    """Lines, points, bars or a colour mesh (or, for an axes of a panel's key, its legend)."""
    key = not ax.axison and ax.get_legend() is not None
    return bool(ax.lines or ax.collections or ax.images or ax.patches or key)


def holds_panels_with_data(ax, instruments) -> bool:
    """A panel made of smaller ones (the gradient tests): axes with data inside its area."""
    return any(
        o is not ax and has_data(o) and ax.bbox.x0 <= o.bbox.x0 and o.bbox.x1 <= ax.bbox.x1 + 1
        and ax.bbox.y0 - 60 <= o.bbox.y0 and o.bbox.y1 <= ax.bbox.y1 + 60
        for o in instruments
    )  # fmt: skip


def shown_tick_labels(ax):
    """The tick labels drawn: those of ticks inside the view limits."""
    for axis, (low, high) in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
        low, high = min(low, high), max(low, high)
        for tick in axis.get_major_ticks() + axis.get_minor_ticks():
            if tick.label1.get_text() and low <= tick.get_loc() <= high:
                yield axis, tick.label1


def says_why(ax) -> bool:
    return any(t.get_text().startswith(("no data", "no ")) for t in ax.texts) or any(
        "Not recorded" in t.get_text() or "To draw them" in t.get_text() for t in ax.texts
    )


def panels(fig):
    """The axes of the instruments (not the groups' frames, not the colour bars)."""
    bars = {c.ax for ax in fig.axes for c in [getattr(ax, "_colorbar", None)] if c}
    return [ax for ax in fig.axes if ax.get_title() not in GROUPS and ax not in bars]


@pytest.mark.parametrize("screen", [plot, plot_secondary, plot_health])
def test_every_panel_has_data_or_says_why_and_every_label_fits(logged, screen, tmp_path):
    fig = screen(logged, tmp_path / "screen.png")
    canvas = FigureCanvasAgg(fig)  # (drawn: the texts' extents are final)
    canvas.draw()
    renderer = canvas.get_renderer()
    figure_box = fig.bbox
    instruments = panels(fig)
    assert instruments
    for ax in instruments:
        assert has_data(ax) or says_why(ax) or holds_panels_with_data(ax, instruments), ax
    for ax in instruments:
        texts = [ax.title, ax.xaxis.label, ax.yaxis.label]
        texts += [label for _, label in shown_tick_labels(ax)]
        legend = ax.get_legend()
        texts += legend.get_texts() if legend else []
        for note in ax.texts:  # what a panel says stays inside it
            box = note.get_window_extent(renderer)
            assert ax.bbox.x0 <= box.x0 and box.x1 <= ax.bbox.x1, (ax.get_title(), note)
        for text in texts:
            box = text.get_window_extent(renderer)
            inside = (
                box.x0 >= figure_box.x0 - 1
                and box.x1 <= figure_box.x1 + 1
                and box.y0 >= figure_box.y0 - 1
                and box.y1 <= figure_box.y1 + 1
            )
            assert inside, (ax.get_title(), text.get_text(), box, figure_box)
        for axis, label in shown_tick_labels(ax):
            if axis is ax.xaxis:
                continue
            if not label.get_text().startswith("$"):  # a name, not a number
                assert len(label.get_text()) <= LABEL_WIDTH, label.get_text()
            box = label.get_window_extent(renderer)
            for other in instruments:
                if other is not ax and other.bbox.overlaps(box) and has_data(other):
                    shared = other.get_shared_x_axes().joined(ax, other) or other.bbox == ax.bbox
                    assert shared, (ax.get_title(), label.get_text(), other.get_title())


def test_the_names_of_a_hugging_face_model_are_shortened_distinctly():
    names = [n for n, _ in real_models.bert_classifier(width=16)[0].named_parameters()]
    assert max(map(len, names)) > 2 * LABEL_WIDTH
    shown = short_labels(names)
    assert max(map(len, shown)) <= LABEL_WIDTH
    assert len(set(shown)) == len(names)
    assert "b.e.l.0.a.s.query.weight" in shown  # bert.bert.encoder.layer.0.attention...
