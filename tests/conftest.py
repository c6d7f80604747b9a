import sys
from pathlib import Path

import pytest
import torch

# tests/models.py is shared by every test folder
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
