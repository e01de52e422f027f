"""From packed records to what a DataLoader gets: decoding, map-style and streaming datasets."""
