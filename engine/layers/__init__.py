"""Model building blocks that know about paging and sharding; model code stays free of rank math."""
