from sharedml.cache._admin import KEY_CHARS as KEY_CHARS
from sharedml.cache._admin import CacheSummary as CacheSummary
from sharedml.cache._admin import EntryStatus as EntryStatus
from sharedml.cache._admin import Removal as Removal
from sharedml.cache._admin import cache_summary as cache_summary
from sharedml.cache._admin import check_entries as check_entries
from sharedml.cache._admin import clear_cache as clear_cache
from sharedml.cache._admin import disk_bytes as disk_bytes
from sharedml.cache._admin import list_entries as list_entries
from sharedml.cache._admin import prune_cache as prune_cache
from sharedml.cache._admin import remove_entries as remove_entries
from sharedml.cache._admin import select_entries as select_entries
from sharedml.cache._admin import verify_entries as verify_entries
from sharedml.cache._locks import LOCKING as LOCKING
from sharedml.cache._root import Cache as Cache
from sharedml.cache._root import CacheDir as CacheDir
from sharedml.cache._root import cache_dir as cache_dir

__all__: list[str]
