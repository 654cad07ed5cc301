//! How results are shown: terminal tables, the JSON report, SVG charts, and the comparison of
//! two JSON reports.

pub mod compare;
pub mod json;
pub mod output;
pub mod readme;
pub mod replay;
pub mod svg;
pub mod table;
