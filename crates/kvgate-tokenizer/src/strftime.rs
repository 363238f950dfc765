//! `strftime_now(format)`: the current date in UTC, formatted with the common C `strftime` directives (Llama 3 templates date their system prompt).

use std::time::{SystemTime, UNIX_EPOCH};

const WEEKDAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// The template global `strftime_now`. transformers formats the engine host's local time; the
/// gateway uses UTC, so prompts rendered around local midnight may differ by a day.
pub(crate) fn strftime_now(format: &str) -> String {
    let seconds = SystemTime::now().duration_since(UNIX_EPOCH).map(|elapsed| elapsed.as_secs()).unwrap_or(0);
    strftime(format, seconds as i64)
}

/// Formats `unix_seconds` (UTC) with `format`. Supports `%a %A %b %B %c %d %D %e %F %h %H %I %j
/// %m %M %p %S %T %u %w %y %Y %z %Z %%` and glibc's `%-d` (no padding); unknown directives are
/// kept as written, as glibc does.
pub(crate) fn strftime(format: &str, unix_seconds: i64) -> String {
    let days = unix_seconds.div_euclid(86_400);
    let second_of_day = unix_seconds.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (second_of_day / 3600, second_of_day / 60 % 60, second_of_day % 60);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday; 0 = Monday
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };

    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars().peekable();
    while let Some(ch) = chars.next() {
        if ch != '%' {
            out.push(ch);
            continue;
        }
        let no_pad = chars.peek() == Some(&'-');
        if no_pad {
            chars.next();
        }
        let number = |value: i64, width: usize| {
            if no_pad {
                value.to_string()
            } else {
                format!("{value:0width$}")
            }
        };
        let Some(directive) = chars.next() else {
            out.push('%');
            break;
        };
        let text = match directive {
            'a' => WEEKDAYS[weekday][..3].to_string(),
            'A' => WEEKDAYS[weekday].to_string(),
            'b' | 'h' => MONTHS[month as usize - 1][..3].to_string(),
            'B' => MONTHS[month as usize - 1].to_string(),
            'c' => format!(
                "{} {} {day:>2} {hour:02}:{minute:02}:{second:02} {year}",
                &WEEKDAYS[weekday][..3],
                &MONTHS[month as usize - 1][..3]
            ),
            'd' => number(day, 2),
            'D' => format!("{month:02}/{day:02}/{:02}", year.rem_euclid(100)),
            'e' if no_pad => day.to_string(),
            'e' => format!("{day:>2}"),
            'F' => format!("{year}-{month:02}-{day:02}"),
            'H' => number(hour, 2),
            'I' => number(hour12, 2),
            'j' => number(day_of_year, 3),
            'm' => number(month, 2),
            'M' => number(minute, 2),
            'p' => if hour < 12 { "AM" } else { "PM" }.to_string(),
            'S' => number(second, 2),
            'T' => format!("{hour:02}:{minute:02}:{second:02}"),
            'u' => (weekday + 1).to_string(),
            'w' => ((weekday + 1) % 7).to_string(),
            'y' => number(year.rem_euclid(100), 2),
            'Y' => year.to_string(),
            'z' => "+0000".to_string(),
            'Z' => "UTC".to_string(),
            '%' => "%".to_string(),
            other => format!("%{}{other}", if no_pad { "-" } else { "" }),
        };
        out.push_str(&text);
    }
    out
}

/// (year, month 1-12, day 1-31) of a day count since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era = (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_index + 2) / 5 + 1;
    let month = if month_index < 10 { month_index + 3 } else { month_index - 9 };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// Days since 1970-01-01 of a civil date (the inverse of `civil_from_days`).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year.rem_euclid(400);
    let month_index = if month > 2 { month - 3 } else { month + 9 };
    let day_of_year = (153 * month_index + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_like_c_strftime() {
        // 2024-07-26 13:05:09 UTC, a Friday (Python: datetime(2024, 7, 26, 13, 5, 9).strftime(...)).
        let moment = 1_721_999_109;
        assert_eq!(strftime("%d %b %Y", moment), "26 Jul 2024");
        assert_eq!(
            strftime("%A, %B %-d, %Y %H:%M:%S %p %j", moment),
            "Friday, July 26, 2024 13:05:09 PM 208"
        );
        assert_eq!(strftime("%F %T %y %I %a %% %Q", moment), "2024-07-26 13:05:09 24 01 Fri % %Q");
        assert_eq!(strftime("%c|%D %e %u %w", moment), "Fri Jul 26 13:05:09 2024|07/26/24 26 5 5");
        assert_eq!(strftime("%Y-%m-%d", 0), "1970-01-01");
        assert_eq!(strftime("%Y-%m-%d %j", 951_782_400), "2000-02-29 060");
        assert_eq!(strftime("%Y-%m-%d", -86_400), "1969-12-31");
        assert!(!strftime_now("%Y").is_empty());
    }
}
