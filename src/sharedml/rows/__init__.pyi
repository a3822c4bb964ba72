from sharedml.rows._dims import BATCH as BATCH
from sharedml.rows._dims import ONE as ONE
from sharedml.rows._dims import ZERO as ZERO
from sharedml.rows._dims import Dim as Dim
from sharedml.rows._dims import opaque as opaque
from sharedml.rows._dims import product as product
from sharedml.rows._engine import RowAnalysis as RowAnalysis
from sharedml.rows._engine import rule_entries as rule_entries
from sharedml.rows._engine import rules_table as rules_table
from sharedml.rows._facts import Fact as Fact
from sharedml.rows._facts import Kind as Kind
from sharedml.rows._facts import Pin as Pin
from sharedml.rows._facts import Refusal as Refusal
from sharedml.rows._registry import RuleEntry as RuleEntry

__all__: list[str]
