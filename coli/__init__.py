from .paths import cache_dir
