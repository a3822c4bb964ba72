from sharedml.prepared._compress import CompressResult as CompressResult
from sharedml.prepared._compress import WeightsFormat as WeightsFormat
from sharedml.prepared._compress import compress as compress
from sharedml.prepared._compress import compressed_model_for as compressed_model_for
from sharedml.prepared._family import FamilyResult as FamilyResult
from sharedml.prepared._family import prepare_family as prepare_family
from sharedml.prepared._format import SharedWeights as SharedWeights
from sharedml.prepared._format import TensorDigest as TensorDigest
from sharedml.prepared._format import WeightsManifest as WeightsManifest
from sharedml.prepared._format import weights_path_for as weights_path_for
from sharedml.prepared._prepare import PrepareResult as PrepareResult
from sharedml.prepared._prepare import prepare as prepare
from sharedml.prepared._prepare import prepared_model_for as prepared_model_for
from sharedml.prepared._static import StaticCompressResult as StaticCompressResult
from sharedml.prepared._static import compress_static as compress_static

__all__: list[str]
