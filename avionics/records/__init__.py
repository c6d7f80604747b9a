"""Run logs: the crash-safe JSON-lines log, reading it back, and exports."""

from avionics.records.export import read_cockpit_json, to_cockpit_json, to_csv
from avionics.records.metadata import describe_optimizer
from avionics.records.mlflow_sink import MlflowSink
from avionics.records.reader import as_run, read_run
from avionics.records.run import Run
from avionics.records.tensorboard import TensorBoardWriter, to_tensorboard
from avionics.records.wandb_sink import WandbSink
from avionics.records.writer import RunWriter

__all__ = [
    "Run",
    "RunWriter",
    "MlflowSink",
    "TensorBoardWriter",
    "WandbSink",
    "describe_optimizer",
    "read_cockpit_json",
    "as_run",
    "read_run",
    "to_cockpit_json",
    "to_csv",
    "to_tensorboard",
]
