"""What the image families share for loading the single files users have: what a file is, from
its header (``inspect``), and the text encoders and VAEs that stand as files of their own or as
parts of a full checkpoint (``text``). Each family's own loader is its ``singlefile`` module."""
