"""partitioner.search: automatic layout search (see ``_search``)."""

from partitioner._search._found import CandidateResult as CandidateResult
from partitioner._search._found import FoundLayout as FoundLayout
from partitioner._search._search import search as search
