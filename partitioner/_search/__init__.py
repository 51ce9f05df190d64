"""partitioner.search: the layout of every argument, found by compiling candidates."""

from partitioner._search.decision import Decision as Decision
from partitioner._search.flow import search as search
from partitioner._search.found import CandidateResult as CandidateResult
from partitioner._search.found import FoundLayout as FoundLayout
from partitioner._search.select import NoLayoutFitsError as NoLayoutFitsError
