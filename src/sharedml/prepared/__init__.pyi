from sharedml.prepared._family import FamilyResult as FamilyResult
from sharedml.prepared._family import prepare_family as prepare_family
from sharedml.prepared._format import SharedWeights as SharedWeights
from sharedml.prepared._format import TensorDigest as TensorDigest
from sharedml.prepared._format import WeightsManifest as WeightsManifest
from sharedml.prepared._format import weights_path_for as weights_path_for
from sharedml.prepared._prepare import PrepareResult as PrepareResult
from sharedml.prepared._prepare import prepare as prepare
from sharedml.prepared._prepare import prepared_model_for as prepared_model_for

__all__: list[str]
