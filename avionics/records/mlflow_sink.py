"""MLflow sink: a run's values as MLflow metrics, parameters and artifacts.

Each step's values (read as :mod:`avionics.records.tracking` reads them) are logged at their
step (``MlflowClient.log_batch``; MLflow takes steps in any order, so a two-step quantity's
value of step t arriving after step t + 1 lands at t):

* ``"Loss"``, ``"GradNorm"``: each value's one number;
* ``"GradNorm_per_parameter/<parameter name>"``: one number per tracked parameter. (Not
  ``"GradNorm/<name>"``: MLflow's file store keeps a metric in a file of its name, so
  ``"GradNorm"`` and ``"GradNorm/..."`` cannot both exist there.)
* histograms: MLflow charts only numbers over steps and has no histogram type, and the
  bins (adaptive ranges) need not be the same from step to step, so one metric per bin would
  be a series whose meaning changes, dozens of them per histogram. Instead a histogram is
  what TensorBoard's distributions view draws: ``"GradHist1d/mean"`` and the quantiles
  ``"GradHist1d/p05"``, ``p25``, ``p50``, ``p75``, ``p95`` (the lines of one chart show the
  distribution widen or narrow over the steps;
  :func:`~avionics.records.tracking.histogram_summary`), and the counts themselves, nothing
  lost, are the artifact ``histograms/GradHist1d/step_<step>.json`` (``{"step", "hist",
  "edges"}``; a 2d histogram whole, its marginals' summaries as metrics).

The run's metadata: its numbers and strings as parameters (``model``, ``avionics``,
``optimizer.name``, ``optimizer.param_groups.0.lr``, ...; MLflow's parameters cannot change,
so each is logged once; a value past MLflow's 6000 characters is cut there) and the whole of
it as the artifact ``avionics/metadata.json``. A name MLflow would refuse (a metric logged as
``cockpit.log(step, **{"val acc (%)": x})``) has each character MLflow does not take replaced
by "_" (:func:`mlflow_key`), so that no name stops the training loop.
Needs the ``mlflow`` package (the ``mlflow`` extra installs ``mlflow-skinny``). MLflow 3
refuses a file store (``file:...``) unless ``MLFLOW_ALLOW_FILE_STORE=true``.
"""

from __future__ import annotations

import re
import time

from avionics.records.tracking import Tracking, flat_parameters, histogram_summary

MAX_BATCH = 1000  # metrics per MlflowClient.log_batch call
MAX_KEY, MAX_VALUE = 250, 6000  # characters of a metric or parameter name, a parameter value
PER_PARAMETER = "_per_parameter"
# (too long, or in the JSON artifact only)
NOT_PARAMETERS = ("summary", "outputs", "quantities", "parameters")


def _mlflow():
    try:
        import mlflow
    except ImportError as error:
        raise ImportError(
            "The MLflow sink needs mlflow: pip install -c constraints.txt 'avionics[mlflow]'"
        ) from error
    return mlflow


def mlflow_key(name: str) -> str:
    """``name`` as MLflow takes it: characters other than letters, digits, "_", "-", ".",
    " " and "/" replaced by "_" (the colon too: Windows refuses it), as are empty, "." and
    ".." parts between slashes (names are files in a file store), cut at 250 characters."""
    parts = re.sub(r"[^/\w.\- ]", "_", name).split("/")
    return "/".join("_" if part in ("", ".", "..") else part for part in parts)[:MAX_KEY]


class MlflowSink:
    """Writes a cockpit's values to an MLflow run: a :class:`~avionics.records.sink.Sink`.

    Args:
        run_id: a run of yours, which this sink writes to and leaves open; None: the sink
            creates a run named ``run_name`` in ``experiment`` (created where it does not
            exist) when the cockpit first hands it the run's metadata, and ends it on
            :meth:`close`. Under data parallelism the cockpit hands its sinks the values on
            rank 0 only, so that only rank 0 creates a run, though every process builds the
            sink.
        tracking_uri: where the runs are (None: MLflow's default, ``MLFLOW_TRACKING_URI``).
            The sink reaches them first when the cockpit hands it the run's metadata, so
            that a process that is handed nothing never touches the store. (Building an
            ``MlflowClient`` on a file store creates the store's default experiment: two
            processes doing so at once can collide on its ``meta.yaml``.)
        experiment: the experiment's name, for a run the sink creates.
        run_name: the run's name, for a run the sink creates.

    Example::

        sink = MlflowSink(tracking_uri="http://localhost:5000", run_name="lr-0.1")
        cockpit = Cockpit(model, log="runs/lr-0.1", sinks=[sink])
    """

    def __init__(
        self,
        run_id: str | None = None,
        tracking_uri: str | None = None,
        experiment: str = "avionics",
        run_name: str | None = None,
    ):
        mlflow = _mlflow()
        self._metric = mlflow.entities.Metric
        self._param = mlflow.entities.Param
        self._client_class, self._tracking_uri = mlflow.MlflowClient, tracking_uri
        self._client = None
        self._owned, self._experiment, self._run_name = run_id is None, experiment, run_name
        self.run_id = run_id
        self._tracking = Tracking()
        self._metadata: dict = {}
        self._logged_parameters: set[str] = set()

    def update_metadata(self, metadata: dict) -> None:
        """Take the outputs and parameter names; log the metadata's new parameters and the
        merged metadata as ``avionics/metadata.json``."""
        self._tracking.update_metadata(metadata)
        self._metadata.update(metadata)
        new = {
            key: value
            for key, value in flat_parameters(metadata, skip=NOT_PARAMETERS).items()
            if key not in self._logged_parameters
        }
        self._logged_parameters.update(new)
        run_id = self._started()
        params = [self._param(mlflow_key(k), v[:MAX_VALUE]) for k, v in new.items()]
        for start in range(0, len(params), 100):  # (log_batch takes 100 parameters at most)
            self.client.log_batch(run_id, params=params[start : start + 100])
        self.client.log_dict(run_id, self._metadata, "avionics/metadata.json")

    def write(self, step: int, values: dict) -> None:
        """Log the scalars, per-parameter numbers and histogram summaries among ``values`` at
        ``step``, and each histogram's counts as an artifact."""
        tracked = self._tracking.read(values)
        numbers = dict(tracked.scalars)
        for name, by_parameter in tracked.parameters.items():
            numbers.update({f"{name}{PER_PARAMETER}/{p}": v for p, v in by_parameter.items()})
        for tag, (counts, edges) in tracked.histograms.items():
            summary = histogram_summary(counts, edges)
            numbers.update({f"{tag}/{statistic}": v for statistic, v in summary.items()})
        run_id, now = self._started(), int(time.time() * 1000)
        metrics = [self._metric(mlflow_key(k), v, now, step) for k, v in numbers.items()]
        for start in range(0, len(metrics), MAX_BATCH):
            self.client.log_batch(run_id, metrics=metrics[start : start + MAX_BATCH])
        for name, value in values.items():
            if self._tracking.counted_histogram(name, value):
                counts = {"step": step, "hist": value["hist"], "edges": value["edges"]}
                path = f"histograms/{mlflow_key(name)}/step_{step:08d}.json"
                self.client.log_dict(run_id, counts, path)

    def close(self) -> None:
        """End the run if the sink created it."""
        if self._owned and self.run_id is not None:
            self.client.set_terminated(self.run_id)

    @property
    def client(self):
        """The ``MlflowClient`` the sink writes with, built at its first use."""
        if self._client is None:
            self._client = self._client_class(tracking_uri=self._tracking_uri)
        return self._client

    def _started(self) -> str:
        """The run's id, the run created first if it is the sink's own and has not been."""
        if self.run_id is None:
            found = self.client.get_experiment_by_name(self._experiment)
            experiment_id = (
                found.experiment_id if found else self.client.create_experiment(self._experiment)
            )
            created = self.client.create_run(experiment_id, run_name=self._run_name)
            self.run_id = created.info.run_id
        return self.run_id
