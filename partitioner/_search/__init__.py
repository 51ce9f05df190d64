"""partitioner.search: automatic layout search (see ``_search``)."""

from partitioner._search._device_model import MODELS as MODELS
from partitioner._search._device_model import DeviceModel as DeviceModel
from partitioner._search._found import CandidateResult as CandidateResult
from partitioner._search._score import Cost as Cost
from partitioner._search._found import FoundLayout as FoundLayout
from partitioner._search._search import clear as clear
from partitioner._search._search import search as search
