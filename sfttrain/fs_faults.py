"""The names other modules imported from here before sfttrain.faults held them; delete this file once
their imports name sfttrain.faults."""

from sfttrain.faults import (SIZE_LIMIT_FIX, check_open_files, check_writable, disk_full, fault,  # noqa: F401
                             file_at_size_limit, folder_gone, open_files_problem, over_size_limit, unreadable)

disk_full_text = disk_full
